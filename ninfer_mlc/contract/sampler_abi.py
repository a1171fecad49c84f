"""The device sampler's calling convention, shared by the compiler and the runtime (no TVM here).

A model library built with the device sampler exports (next to decode / prefill / verify):

  sample(logits[n, V] f32, params[n, NUM_PARAMS] f64, mask[n, W] i32, counts[L, V] i32,
         prompt[L, W] i32, bias[L, V] f32)
      -> (tokens[n] i32, token_logprob[n] f32, rank[n] i32, top_ids[n, K] i32, top_logprobs[n, K] f32, counts)
  sampler_counts_add(lanes[m] i32, tokens[m] i32, delta[m] i32, counts[L, V] i32) -> counts

with W = mask_words(V) and K = top_logprob_slots(V). `params` holds one row of the columns below per logits row;
`counts` (generated-token counts), `prompt` (prompt-token bits) and `bias` (dense logit_bias) are persistent per-lane
buffers the runtime owns and passes in (`counts` is updated in place). `mask` is an xgrammar-layout bitmask: bit j
of word i allows token 32 i + j. A token of -1 means every token of the row was masked. The manifest records
`extras["device_sampler"] = ABI_VERSION`; a library without it (or with another version) samples on the host.
"""
from __future__ import annotations

ABI_VERSION = 1

# columns of the float64 row-parameter table (integers are stored exactly: |value| < 2**53)
P_LANE = 0  # penalty-state lane of the row
P_TOP_K = 1  # 0: off
P_FLAGS = 2  # F_* bits
P_TEMPERATURE = 3  # 0: greedy
P_TOP_P = 4  # 1: off
P_MIN_P = 5  # 0: off
P_REPETITION = 6  # repetition_penalty (F_REPETITION)
P_FREQUENCY = 7  # frequency_penalty (F_FREQ_PRES)
P_PRESENCE = 8  # presence_penalty (F_FREQ_PRES)
P_UNIFORM = 9  # the row's one uniform in [0, 1) (ignored when greedy)
NUM_PARAMS = 10

F_BIAS = 1  # add the lane's dense logit_bias
F_REPETITION = 2  # repetition penalty over prompt + generated tokens
F_FREQ_PRES = 4  # frequency / presence penalties over generated tokens
F_MASK = 8  # apply the row's bitmask
F_APPEND = 16  # add the sampled token to the lane's counts
F_LOGPROBS = 32  # compute the logprob outputs of the row
F_LP_PROCESSED = 64  # logprobs of the processed logits (/ temperature) instead of the raw ones

MAX_TOP_LOGPROBS = 20  # sampling.MAX_TOP_LOGPROBS

# orderable uint32 keys of float32 logits: key(a) < key(b) iff a < b; NaN ranks as -inf, -0 as +0,
# a masked token gets MASKED_KEY (below every logit, -inf included)
MASKED_KEY = 0
KEY_NEG_INF = 0x007FFFFF
KEY_POS_INF = 0xFF800000

SAMPLE_FUNCTION = "sample"
COUNTS_ADD_FUNCTION = "sampler_counts_add"


def mask_words(vocab_size: int) -> int:
    """int32 words per bitmask row (xgrammar: ceil(V / 32))."""
    return (int(vocab_size) + 31) // 32


def top_logprob_slots(vocab_size: int) -> int:
    return min(MAX_TOP_LOGPROBS, int(vocab_size))


def weight_bits(vocab_size: int) -> int:
    """Fixed-point fraction bits of the sampling weights: a row's V weights (each <= 1.0) sum below 2**63."""
    return 63 - max(1, (int(vocab_size) - 1).bit_length())
