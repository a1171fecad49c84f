"""The device round's host side (issue 16): its inputs go up in one host->device copy (executor/upload_batch.py),
views are made once (executor/view_cache.py), the MTP chain reads only its round's tokens (Request.tokens_between).

* a batch puts every value (int32 and float32, 1-D and 2-D views, a destination added twice) where a copy per
  input would, with one host->device copy; discard leaves the destinations alone; bad input is a clear error;
* a verify staged into a batch with the draft chain gives the device the inputs a verify staged alone gives, and
  neither the verify nor the chain launches while the batch holds unsent inputs;
* cached views are the same objects for the same (base, shape, offset) and differ otherwise.
The device rounds' outputs with these inputs are tests/test_spec_device.py and test_spec_decode.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.engine import GenRequest
from ninfer_mlc.runtime.executor.upload_batch import UploadBatch
from ninfer_mlc.runtime.executor.view_cache import ViewCache
from ninfer_mlc.runtime.harness import Harness
from ninfer_mlc.runtime.sampling import SamplingParams
from ninfer_mlc.runtime.scheduler.request import Request
from ninfer_mlc.runtime.tokenizer import load_tokenizer

ART = default_model_dir()


@pytest.fixture(scope="module")
def runner():
    return Harness(ART, num_slots=4, kv_capacity_tokens=512)


def _empty(runner, shape, dtype="int32"):
    return runner.tvm.runtime.tensor(np.full(shape, -7, dtype), runner.dev)


def test_one_copy_places_every_input(runner):
    ub = UploadBatch(runner.tvm, runner.dev, capacity=8)  # grows past its first capacity
    a, b, c = _empty(runner, (5,)), _empty(runner, (3, 4)), _empty(runner, (2, 6), "float32")
    va, vb, vc = np.arange(5, dtype=np.int32), np.arange(12, dtype=np.int32).reshape(3, 4) * 3, \
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(2, 6)
    ub.add(a, va)
    ub.add(b, vb)
    ub.add(c, vc)
    va[:] = 99  # values were taken at add: the caller may reuse its array
    ub.add(a, np.arange(5, dtype=np.int32) + 10)  # added twice: the last values win
    assert ub.pending == 4
    ub.send()
    assert ub.pending == 0 and ub.sends == 1
    assert a.numpy().tolist() == list(range(10, 15))
    assert (b.numpy() == vb).all() and (c.numpy() == vc).all()
    ub.add(a, np.zeros(5, np.int32))
    ub.discard()
    ub.send()  # nothing left to send
    assert a.numpy().tolist() == list(range(10, 15)) and ub.sends == 1
    with pytest.raises(ValueError, match="values for a device view"):
        ub.add(a, np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="4-byte"):
        ub.add(a, np.zeros(5, np.int64))


def _device_inputs(args) -> list:
    return [x.numpy().tolist() for x in args]


def test_batched_verify_inputs_match_a_verify_staged_alone(runner):
    seqs = []
    for n in (7, 11):
        s = runner.new_seq()
        runner.prefill([(s, list(range(3, 3 + n)))])
        runner.reserve(s, 4)
        seqs.append(s)
    batch = [(seqs[0], [5, 6, 7, 8]), (seqs[1], [9, 10, 11])]
    alone = runner.stage_verify(batch)
    want = _device_inputs(alone[2])
    ub = runner.upload_batch()
    staged = runner.stage_verify([(s, [1] * len(t)) for s, t in batch], uploads=ub)  # other values first
    staged = runner.stage_verify(batch, uploads=ub)
    with pytest.raises(RuntimeError, match="not sent"):
        runner.run_verify(staged)
    with pytest.raises(RuntimeError, match="not sent"):
        runner.run_draft_chain((1, [], [], False), lambda logits: logits)
    ub.send()
    assert _device_inputs(staged[2]) == want and list(staged[3]) == list(alone[3])
    for s in seqs:
        runner.free_seq(s)


def test_view_cache(runner):
    base = _empty(runner, (64,))
    views = ViewCache(limit=3)
    v = views(base, (4,), "int32", 16)
    assert views(base, (4,), "int32", 16) is v
    assert views(base, (4,), "int32", 0) is not v and views(base, (2, 2), "int32", 16) is not v
    base.copyfrom(np.arange(64, dtype=np.int32))
    assert v.numpy().tolist() == [4, 5, 6, 7]
    views(base, (1,), "int32", 4)  # past the limit: the cache starts over, views stay valid
    assert v.numpy().tolist() == [4, 5, 6, 7]


def test_tokens_between():
    tok = load_tokenizer(ART)
    req = Request(0, GenRequest([11, 12, 13, 14], SamplingParams()), SimpleNamespace(), 16, set(), tok)
    req.generated = [21, 22, 23]
    full = req.all_tokens()
    for lo in range(len(full) + 1):
        for hi in range(lo, len(full) + 2):
            assert req.tokens_between(lo, hi) == full[lo:hi]
