"""Models named by Hub repo id: download (here: a fake repo in a temporary Hugging Face cache, laid
out as huggingface_hub writes it), offline and unreachable-Hub errors, index-driven shard choice,
and the compile-once artifact cache behind `ninfer serve/generate REPO_ID`. No network is used:
HF_HUB_OFFLINE is set, or the endpoint is a closed loopback port."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

import pytest

from ninfer_mlc.compile.options import CompileOptions
from ninfer_mlc.compile.progress import SILENT
from ninfer_mlc.contract.safetensors_io import SafetensorsError, weight_files
from ninfer_mlc.hub import HubError, HubRef, fetch, parse_ref

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT_V1 = "fedcba9876543210fedcba9876543210fedcba98"
LLVM_F32 = CompileOptions(target="llvm", quant="f32")


def cache_repo(cache: Path, repo_id: str, files: dict, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put `files` ({repo path: Path or bytes}) into an HF cache as huggingface_hub lays it out:
    blobs by content hash, snapshots/<commit>/ of relative symlinks, refs/<ref> naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        dst = snap / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(os.path.relpath(blob, dst.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from ninfer_mlc.compile import tiny_default

    return tiny_default.generate(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, offline; the ninfer artifact cache in tmp_path too."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "ninfer"))
    return cache


def tiny_files(tiny_hf: Path) -> dict:
    return {f.name: f for f in tiny_hf.iterdir() if f.is_file()}


# ---- repo ids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,ref", [
    ("Qwen/Qwen3.6-27B", HubRef("Qwen/Qwen3.6-27B")),
    ("org/model@v1.0", HubRef("org/model", "v1.0")),
    ("org/model@refs/pr/3", HubRef("org/model", "refs/pr/3")),
    ("org/model@", None), ("model", None), ("a/b/c", None), ("/abs/dir", None), ("./dir", None),
    ("org/bad--name", None), ("org/na me", None),
])
def test_parse_ref(text, ref):
    assert parse_ref(text) == ref


# ---- fetching from the cache --------------------------------------------------------------------
def test_offline_fetch_finds_the_cached_snapshot(hf_cache, tiny_hf):
    import huggingface_hub

    snap = cache_repo(hf_cache, "org/tiny", tiny_files(tiny_hf))
    got = fetch(parse_ref("org/tiny"))
    assert got.path == snap and got.commit == COMMIT and got.name == "tiny"
    assert (got.path / "config.json").is_file() and (got.path / "model.safetensors").is_file()
    # the layout is one huggingface_hub itself reads
    repos = {r.repo_id: r for r in huggingface_hub.scan_cache_dir(hf_cache).repos}
    assert {f.file_name for f in next(iter(repos["org/tiny"].revisions)).files} >= {"config.json", "tokenizer.json"}


def test_offline_fetch_of_a_revision(hf_cache, tiny_hf):
    cache_repo(hf_cache, "org/tiny", tiny_files(tiny_hf))
    snap = cache_repo(hf_cache, "org/tiny", tiny_files(tiny_hf), commit=COMMIT_V1, ref="v1")
    got = fetch(parse_ref("org/tiny@v1"))
    assert got.path == snap and got.commit == COMMIT_V1


def test_offline_and_not_cached_names_the_repo(hf_cache):
    t0 = time.monotonic()
    with pytest.raises(HubError) as e:
        fetch(parse_ref("org/absent@v2"))
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert msg.startswith("org/absent@v2:") and "HF_HUB_OFFLINE" in msg and str(hf_cache) in msg


def test_incomplete_cached_snapshot_says_what_is_missing(hf_cache, tiny_hf):
    files = tiny_files(tiny_hf)
    del files["tokenizer.json"]
    cache_repo(hf_cache, "org/tiny", files)
    with pytest.raises(HubError, match=r"org/tiny: .*tokenizer\.json"):
        fetch(parse_ref("org/tiny"))


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused at once
    return port


@pytest.fixture()
def unreachable_hub(hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    return hf_cache


def test_unreachable_hub_fails_fast_naming_the_repo(unreachable_hub):
    from ninfer_mlc.cli import main

    t0 = time.monotonic()
    with pytest.raises(HubError) as e:
        fetch(parse_ref("org/absent"))
    assert time.monotonic() - t0 < 30
    assert str(e.value).startswith("org/absent: the Hugging Face Hub cannot be reached")
    with pytest.raises(SystemExit) as ex:  # the CLI: one line, exit status 2
        main(["compile", "org/absent", "-o", str(unreachable_hub / "out")])
    assert ex.value.code == 2


def test_unreachable_hub_falls_back_to_the_cache(unreachable_hub, tiny_hf):
    snap = cache_repo(unreachable_hub, "org/tiny", tiny_files(tiny_hf))
    assert fetch(parse_ref("org/tiny")).path == snap


# ---- which weight files ---------------------------------------------------------------------------
def test_weight_files_follow_the_index(tmp_path):
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in weight_files(tmp_path)] == sorted(p.name for p in tmp_path.iterdir())
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                            "c": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SafetensorsError, match="00002"):
        weight_files(tmp_path)


# ---- compile once, reuse -----------------------------------------------------------------------------
def test_hub_model_compiles_once_into_the_cache(hf_cache, tiny_hf, tmp_path, monkeypatch, capsys):
    import ninfer_mlc.compile.build as build
    from ninfer_mlc.artifact_cache import compiler_fingerprint
    from ninfer_mlc.cli import main
    from ninfer_mlc.contract.manifest import read_manifest
    from ninfer_mlc.model_source import artifact_for

    cache_repo(hf_cache, "org/tiny", tiny_files(tiny_hf))
    variant = tmp_path / "ninfer" / "artifacts" / "org--tiny" / COMMIT[:12] / f"llvm-f32-kvdefault-c{compiler_fingerprint()}"
    partial = variant.with_name(variant.name + ".partial")
    partial.mkdir(parents=True)
    (partial / "junk").write_text("left by an interrupted compile")
    logs: list[str] = []
    art, repo = artifact_for("org/tiny", LLVM_F32, Path("unused"), SILENT, logs.append)
    assert (art, repo) == (variant, "org/tiny") and not partial.exists()
    m = read_manifest(art, verify="full")
    assert m.name == "tiny-f32-llvm" and m.target == "llvm"

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(build, "compile_model", no_compile)
    logs.clear()
    assert artifact_for("org/tiny", LLVM_F32, Path("unused"), SILENT, logs.append) == (variant, "org/tiny")
    assert any("using the compiled model" in line for line in logs)

    # the whole command line on the cached artifact
    capsys.readouterr()
    assert main(["generate", "org/tiny", "hello", "--max-tokens", "3", "--target", "llvm", "--quant", "f32"]) == 0
    assert capsys.readouterr().out.strip()


def test_serve_hook_serves_a_hub_model_under_its_repo_id(hf_cache, tiny_hf, monkeypatch):
    """resolve_model (run_server's hook) turns a repo id into the cached artifact and names the model."""
    import argparse

    import ninfer_mlc.artifact_cache as cache
    from ninfer_mlc.cli_support import resolve_model

    cache_repo(hf_cache, "org/tiny", tiny_files(tiny_hf))
    compiled = []
    monkeypatch.setattr(cache, "compiled_artifact", lambda src, key, name, opts, *a: compiled.append((key, name, opts))
                        or Path("/compiled"))
    args = argparse.Namespace(model="org/tiny@main", model_id=None, target="llvm", quant="auto", kv_dtype="fp8",
                              max_context=64)
    assert resolve_model(args, Path("default")) == Path("/compiled") and args.model_id == "org/tiny"
    key, name, opts = compiled[0]
    assert key == f"org--tiny/{COMMIT[:12]}" and name == "tiny-f32-llvm"
    assert (opts.target, opts.quant, opts.kv_dtype, opts.max_context) == ("llvm", "f32", "fp8", None)
    args = argparse.Namespace(model=None, model_id=None, target="auto", quant="auto", kv_dtype=None)
    assert resolve_model(args, Path("default")) == Path("default") and args.model_id is None


def test_local_source_key_tracks_the_weights(tiny_hf, tmp_path):
    import shutil

    from ninfer_mlc.artifact_cache import local_source_key

    d = tmp_path / "m"
    shutil.copytree(tiny_hf, d)
    key = local_source_key(d)
    assert key.startswith("local--m-") and local_source_key(d) == key
    w = d / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert local_source_key(d) != key


@pytest.mark.parametrize("indexed", [True, False])
def test_online_fetch_downloads_only_what_a_compile_reads(hf_cache, monkeypatch, indexed):
    """The files asked of the Hub (a stand-in for snapshot_download that applies huggingface_hub's own
    pattern filter to a remote file list): metadata, the index and the shards it names, nothing else."""
    import types

    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import filter_repo_objects

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    index = json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    remote = {name: b"{}" for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
                                       "generation_config.json", "chat_template.jinja", "preprocessor_config.json",
                                       "additional_chat_templates/tool_use.jinja")}
    remote.update({"model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
                   "mtp/model.safetensors": b"m", "pytorch_model.bin": b"p"})
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    if indexed:  # a consolidated copy beside the shards is not fetched
        remote.update({"model.safetensors.index.json": index.encode(), "consolidated.safetensors": b"c"})
        shards = ["model.safetensors.index.json"] + shards
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo_id, revision=None, timeout=None: types.SimpleNamespace(sha=COMMIT))
    asked = []

    def snapshot_download(repo_id, revision, allow_patterns=None, ignore_patterns=None, cache_dir=None,
                          local_files_only=False):
        assert revision == COMMIT and not local_files_only
        chosen = list(filter_repo_objects(remote, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        asked.extend(chosen)
        return str(cache_repo(hf_cache, repo_id, {n: remote[n] for n in chosen}))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    snap = fetch(parse_ref("org/big"))
    assert snap.commit == COMMIT
    assert sorted(asked) == sorted(["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                                    "chat_template.jinja", "additional_chat_templates/tool_use.jinja"] + shards)
    assert [p.name for p in weight_files(snap.path)] == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize("cc,target,quant", [(None, "llvm", "f32"), ("9.0", "cuda:sm_90", "nvfp4"),
                                             ("12.0", "cuda:sm_120", "nvfp4"), ("8.6", None, None)])
def test_auto_target_and_quant(cc, target, quant, monkeypatch):
    """--target auto / --quant auto (the serve/generate/bench defaults) for this machine's GPU, faked here."""
    import types

    import tvm

    from ninfer_mlc.compile.targets import TargetError

    fake = types.SimpleNamespace(exist=cc is not None, compute_version=cc)
    monkeypatch.setattr(tvm.runtime, "device", lambda kind, index=0: fake)
    auto = CompileOptions(target="auto", quant="auto", kv_dtype="fp8")
    if target is None:
        with pytest.raises(TargetError, match=r"compute capability 8\.6.*--target llvm"):
            auto.resolved()
        return
    got = auto.resolved()
    assert (got.target, got.quant, got.kv_dtype) == (target, quant, "fp8")
    assert CompileOptions(target="auto", quant="bf16").resolved().quant == "bf16"  # explicit choices stay
