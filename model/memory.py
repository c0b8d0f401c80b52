"""Decoding-cache bytes per sequence, computed from a `MarathonConfig` (what `MarathonCache` allocates).

Per layer, for a sequence of T tokens (kv = bytes of the model dtype, e.g. 2 for bf16; states are fp32):
    L  linear:   [(W-1) (2 H K + H V)  conv states  +  H K V  recurrent state] * 4      constant in T
    S  sliding:  min(T, window-1) * 2 * Hkv * head_dim * kv
    G  MLA:      T * (kv_lora_rank + qk_rope_head_dim) * kv
Reference designs over the same depth, for comparison: full MHA (every layer keeps 2 H head_dim per token),
GQA (2 Hkv head_dim), MLA everywhere.
"""

from __future__ import annotations

from model.config import MarathonConfig

FP32 = 4


def layer_cache_bytes(config: MarathonConfig, kind: str, tokens: int, kv_bytes: int = 2) -> int:
    c = config
    if kind == "L":
        H, K, V = c.linear_num_heads, c.linear_head_k_dim, c.linear_head_v_dim
        return ((c.linear_conv_kernel - 1) * (2 * H * K + H * V) + H * K * V) * FP32
    if kind == "S":
        return min(tokens, c.sliding_window - 1) * 2 * c.num_key_value_heads * c.head_dim * kv_bytes
    if kind == "G":
        return tokens * (c.kv_lora_rank + c.qk_rope_head_dim) * kv_bytes
    raise ValueError(f"unknown layer kind {kind!r}")


def cache_bytes(config: MarathonConfig, tokens: int, kv_bytes: int = 2) -> int:
    """The hybrid layout's cache for one sequence of `tokens` tokens."""
    return sum(layer_cache_bytes(config, kind, tokens, kv_bytes) for kind in config.layer_kinds)


def design_cache_bytes(config: MarathonConfig, tokens: int, kv_bytes: int = 2) -> dict[str, int]:
    """{design: bytes} for full MHA, GQA, MLA on every layer, and the config's hybrid layout."""
    c, n = config, config.num_hidden_layers
    return {
        "MHA": n * tokens * 2 * c.num_attention_heads * c.head_dim * kv_bytes,
        "GQA": n * tokens * 2 * c.num_key_value_heads * c.head_dim * kv_bytes,
        "MLA": n * layer_cache_bytes(c, "G", tokens, kv_bytes),
        "hybrid": cache_bytes(c, tokens, kv_bytes),
    }


def layout_summary(config: MarathonConfig) -> str:
    """e.g. "20L+7G" (S layers with their window)."""
    kinds = config.layer_kinds
    parts = [f"{kinds.count(k)}{k}" for k in "LSG" if k in kinds]
    return "+".join(parts) + (f" (window {config.sliding_window})" if "S" in kinds else "")


def designs_summary(config: MarathonConfig) -> str:
    c = config
    return (f"MHA: {c.num_attention_heads} heads x {c.head_dim}; GQA: {c.num_key_value_heads} KV heads x {c.head_dim}; "
            f"MLA: latent {c.kv_lora_rank} + rope key {c.qk_rope_head_dim}; linear state {c.linear_num_heads} x "
            f"{c.linear_head_k_dim} x {c.linear_head_v_dim} fp32 (+ conv {c.linear_conv_kernel - 1} taps)")


# -- learner (training) memory per rank ---------------------------------------------------------------------------
KDA_BYTES_PER_TOKEN_HEAD = 6900  # the Triton kernel's fwd+bwd intermediates, K = V = 128 (H200: 108 GiB at 1M x 16 heads)
LAYER_SEGMENT = 1 << 16  # model.chunking.TOKEN_CHUNK: longer rows run a KDA layer segment by segment, MLA heads in groups
EXPERT_CHUNK = 1 << 17  # model.moe.Experts.TOKEN_CHUNK
HEAD_CHUNK = 1024  # learner.logprobs.CHUNK_TOKENS
KDA_CHUNK = 64  # kernels.gated_delta_triton.CHUNK
ZERO3_SUB_GROUP = 10**9  # DeepSpeed's default zero_optimization.sub_group_size (elements)


def layer_activations(config: MarathonConfig, layer: int, a: int = 2, compiled: bool = False) -> int:
    """Bytes per token that decoder layer ``layer`` keeps for its backward when its halves are not checkpointed,
    ``a`` bytes per activation (2 in bf16). An estimate from the layer shapes, of the tensors the eager modules
    save: each half's input mix (two fp32 copies of every source in bf16, one in fp32) and RMSNorm (two fp32 [D],
    the normed input); KDA's projections, short convs, fp32 q/k norms, gates and output norm, and the Triton
    kernel's saved tensors (q, k, v, w, kd, qg, U; the fp32 gate cumsum and two [64] fp32 tiles; one [K, V] state
    per 64-token chunk: kernels/gated_delta_triton/chunk.py); flash attention's q, k, v, output (S: with the fp32
    RoPE tables; G: the normed latent, the kv projection, gate and gated output); the MoE's fp32 router input,
    top-k sorted copies of the input, expert activations and outputs, and the shared expert's; SwiGLU's 4 F.
    Rows over ``LAYER_SEGMENT`` tokens run a KDA layer and the token-local work in recomputed chunks: they keep
    less.

    ``compiled``: the token-local modules under ``learner.compile`` (``learner/compile.py``), whose AOTAutograd
    graphs save their bf16 inputs and recompute the fp32 elementwise work in backward: a half's glue keeps its
    new input (the previous half's output, or the embedding), the mix output when it mixes n > 1 sources, the
    normed input and 3 fp32 statistics per source (none of the fp32 copies); KDA keeps its projections and
    short-conv inputs (4 H K + 3 H V) in bf16 only, with one fp32 [H, K] (the gate logits); S drops the RoPE
    tables, G keeps the latent norm's bf16 input and output (not its fp32 copies); SwiGLU 3 F (the SiLU is
    recomputed). The kernels' (KDA, flash attention) and the experts' terms are the same in both.

    Measured on CPU with saved-tensor hooks (they see what compiled functions save), bf16, ``learner-bench``
    widths (12 layers, vocab cut to 1024): bytes per token from rows of 768 and 256 tokens, each saved storage
    counted once if still alive after the forward, the CPU paths of the KDA kernel and attention left out (the
    terms above stand for those kernels). Eager -> compiled, KB per token and layer: L 193-321 -> 83-123 (the
    eager glue grows with the attention-residual sources), S 173-239 -> 89, G 186-251 -> 100; with the kernel
    terms 3.33 -> 1.69 MB per token over the 12 layers. These terms are within 0.3% of both (the router's fp32
    statistics, 0.1%, are not modelled; the eager terms were within 3% in fp32)."""
    c, f = config, 4
    D, H, K, V = c.hidden_size, c.linear_num_heads, c.linear_head_k_dim, c.linear_head_v_dim
    kind = c.layer_kinds[layer]
    if kind == "L":
        kernel = H * ((5 * K + 2 * V + K * V // KDA_CHUNK) * a + (K + 2 * KDA_CHUNK) * f)
        if compiled:
            mixer = (4 * H * K + 3 * H * V) * a + H * K * f + (K + V) * a + 4 * H * f + kernel
        else:
            mixer = (4 * H * K + 3 * H * V) * (a + f) + (K + V) * a + H * f + kernel
    elif kind == "S":
        rope = 0 if compiled else 2 * c.head_dim * f
        mixer = (3 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * a + rope
    else:
        qk, v, r = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        latent = (2 * r + c.qk_rope_head_dim) * a if compiled else r * (2 * f + a)
        mixer = latent + c.mla_num_heads * ((2 * qk + c.qk_nope_head_dim + 5 * v) * a + f)
    swiglu = 3 if compiled else 4  # SwiGLU's activations kept, in F
    if layer >= c.first_k_dense:
        Fm, Fs = c.moe_intermediate_size, c.moe_intermediate_size * c.n_shared_experts
        ffn = D * f + c.num_experts_per_tok * (2 * D + 3 * Fm) * a + (D + swiglu * Fs) * a
    else:
        ffn = swiglu * c.intermediate_size * a
    sources = (1, 1)  # the mixer's and the FFN's: the stream, or the completed blocks and the partial one
    if c.attn_residual:
        blocks = 1 + layer // c.attn_residual_block_size
        sources = (blocks + (layer % c.attn_residual_block_size > 0), blocks + 1)
    if compiled:
        glue = sum((2 + (n > 1)) * D * a + (1 + 3 * n * (n > 1)) * f for n in sources)
    else:
        copies = 2 if a < f else 1  # fp32 copies of each source the mix keeps (``.float()`` copies a bf16 one)
        glue = sum((copies * n * f if n > 1 else 0) + 2 * f + a for n in sources) * D
    return glue + mixer + ffn


def checkpointed_layers(L: int, T: int, checkpointing: bool, recompute_min_tokens: int = 0,
                        recompute_layers: int | None = None) -> int:
    """How many of ``L`` decoder layers a row of ``T`` tokens per CP rank checkpoints (``learner/recompute.py``):
    none without checkpointing or under ``recompute_min_tokens``, else the first ``recompute_layers`` (None: all)."""
    if not checkpointing or T < recompute_min_tokens:
        return 0
    return L if recompute_layers is None else min(L, recompute_layers)


def _states(P: int, zero_stage: int, ranks: int, bf16: bool) -> tuple[dict[str, int], int]:
    """One rank's bytes of the ``P`` parameters' weights, gradients and optimizer state (see
    `learner_memory_bytes`), and of the fp32 gradient copies a bf16 optimizer makes inside its step (the learner's
    flat one at ZeRO-0, DeepSpeed's at ZeRO 1-3): all of the rank's shard at ZeRO 0-2, one sub-group at a time at
    ZeRO-3 (``zero_optimization.sub_group_size``, 1e9 elements)."""
    w, shards = 2 if bf16 else 4, ranks if zero_stage >= 1 else 1
    shard = P // shards
    states = {"weights": P * w // (ranks if zero_stage >= 3 else 1),
              "grads": P * w // (ranks if zero_stage >= 2 else 1),
              "optimizer": P * (8 + (4 if bf16 else 0)) // shards}
    step_grads = 4 * (min(shard, ZERO3_SUB_GROUP) if zero_stage == 3 else shard) if bf16 else 0
    return states, step_grads


def learner_memory_bytes(config: MarathonConfig, tokens: int, zero_stage: int = 0, dp: int = 1, cp: int = 1,
                         bf16: bool = True, checkpointing: bool = True, offload: bool = False,
                         recompute_min_tokens: int = 0, compiled: bool = False,
                         recompute_layers: int | None = None, accumulating: bool = True) -> dict[str, int]:
    """Predicted peak bytes of one learner rank for a micro-batch (packed row) of ``tokens`` tokens; each part is
    what is alive at the peak.

    states:  weights P * w (w = 2 in bf16, 4 in fp32), gradients P * w, optimizer: AdamW moments 8 P plus, in bf16,
             fp32 master weights 4 P; ZeRO-1 shards the optimizer over ``dp`` ranks, ZeRO-2 also the gradients,
             ZeRO-3 also the weights. The bf16 optimizers (``learner/optimizer.py`` at ZeRO-0, DeepSpeed's wrappers
             at 1-3; bf16 gradients) make fp32 copies of the gradients only inside the optimizer step, when the
             activations are gone (`_states`). The gradients exist from the backward to the step: DeepSpeed sets
             them to None after each step (its engine at ZeRO-0, its ZeRO-1/2 optimizer), so the forward of an
             update's first micro-batch (``accumulating`` False) runs beside the head's weight gradient only; the
             later micro-batches' beside all of them. At ZeRO-3 they are always counted.
    saved:   with activation checkpointing (per half-layer), each half's input [T, D] stays alive until the
             backward: two per layer (a block's first mixer reads the block list alone, whose completed blocks,
             the embedding first, are kept instead); with ``offload`` (``learner/offload.py``) only the blocks stay
             on the device. Without checkpointing (or on a row of fewer than ``recompute_min_tokens`` tokens per CP
             rank: ``learner/recompute.py``), everything each half-layer saves (`layer_activations`; ``compiled``: under
             ``learner.compile``). With ``recompute_layers`` = k (only the first k layers checkpointed), k / L of
             the checkpointed term plus what the later layers save (`layer_activations` of layers k..L-1).
    transient: what the peak adds above the saved activations, at whichever of three moments is highest:
             - the end of the forward, every saved activation alive: the chunked LM head (a chunk's fp32 logits,
               the hidden states and their gradient; the fused head computes its gradients in the forward,
               ``learner.logprobs.fused_head_loss``);
             - the backward of a recomputed layer, when the later layers' activations are freed: the largest
               layer's recompute + backward (a KDA layer's kernel intermediates, calibrated on the H200, and kernel
               inputs q/k/v/gate with their gradients for one segment of at most ``LAYER_SEGMENT`` tokens (longer
               rows run the layer segment by segment), plus the row's input, output and their gradients; the MoE
               on one expert chunk (top-k sorted copies of x, expert activations, output); gated MLA's q/k/v/out
               for one group of heads (fewer heads per group past 4 x ``LAYER_SEGMENT`` tokens) plus the row's
               input and output), beside the checkpointed inputs (with ``offload``, the blocks and the one input
               copied back for the recompute) and the gradients of the attention-residual blocks (every later layer
               reads them, so theirs accumulate);
             - the optimizer step, all activations freed (none counted): the fp32 gradients.
    ``tokens`` is per CP rank after dividing by ``cp``. A prediction, printed beside measurements by
    ``marathon bench learner``; not a bound. On one H100 80GB (``learner-bench``, bf16, compiled, a 64K row of 7
    episodes, ``benchmarks/learner/h100``), measured / predicted GiB with 7, 8, 9 of 12 layers recomputed, one
    micro-batch (the end of the forward is the peak): 73.3 / 73.5, 66.5 / 66.4, 55.9 / 56.2 (73.7 at ZeRO-2 with 7);
    5 micro-batches of up to 64K, 7 layers: 76.5 / 76.5; one 512K-token episode, every layer recomputed, inputs
    offloaded, eager: 63.9 / 60.3 (a layer's backward is the peak; under by 6%). On one H200 (``benchmarks/learner/
    h200``, fifth lease), the same 64K row with 0 and 1 layers recomputed: 130.9 / 130.2, 122.6 / 122.4; one
    1M-token episode, offloaded, eager: 102.0 / 82.3 (under by 19%: not yet traced)."""
    import torch

    from model.modeling import MarathonForCausalLM

    c, T = config, -(-tokens // cp)
    with torch.device("meta"):
        P = MarathonForCausalLM(c).parameter_counts()["total"]
    a = 2 if bf16 else 4
    states, step_grads = _states(P, zero_stage, dp, bf16)
    D, kinds = c.hidden_size, c.layer_kinds
    blocks = -(-len(kinds) // c.attn_residual_block_size) if c.attn_residual else 0  # blocks started
    H, K, V = c.linear_num_heads, c.linear_head_k_dim, c.linear_head_v_dim
    seg = min(T, LAYER_SEGMENT)
    kda = seg * H * KDA_BYTES_PER_TOKEN_HEAD * (K + V) // 256 + seg * H * (3 * K + V) * a * 2 + 4 * T * D * a
    te = min(T, EXPERT_CHUNK) * c.num_experts_per_tok
    moe = te * (3 * D * a + 3 * c.moe_intermediate_size * a) + 3 * T * D * a
    heads = max(1, min(c.mla_num_heads, c.mla_num_heads * 4 * LAYER_SEGMENT // T))  # GatedMLA._heads_per_group
    mla = T * heads * (2 * (c.qk_nope_head_dim + c.qk_rope_head_dim) + 2 * c.v_head_dim) * a * 2 + 4 * T * D * a
    head = 3 * HEAD_CHUNK * c.vocab_size * 4 + 2 * T * D * a
    # + the gradients of the completed attention-residual blocks, which accumulate through the whole backward
    layer = max(kda if "L" in kinds else 0, mla if "G" in kinds else 0, moe) + blocks * T * D * a
    halves = 0 if offload else 2 * len(kinds) - blocks
    L = len(kinds)
    k = checkpointed_layers(L, T, checkpointing, recompute_min_tokens, recompute_layers)
    checkpointed = (halves + blocks) * T * D * a * k // L
    restored = T * D * a if offload and k else 0  # an offloaded half's input, back on the device for its recompute
    saved = checkpointed + T * sum(layer_activations(c, i, a, compiled) for i in range(k, L))
    grads = states.pop("grads")
    early = grads if accumulating or zero_stage == 3 else c.vocab_size * D * a  # alive in the forward
    # (grads, saved activations, transient) at the forward's end, a recomputed layer's backward, the optimizer step
    moments = [(early, saved, head), (grads, checkpointed + restored, layer), (grads, 0, step_grads)]
    grads, saved, transient = max(moments, key=sum)
    out = {"weights": states["weights"], "grads": grads, "optimizer": states["optimizer"],
           "saved_activations": saved, "transient": transient}
    out["total"] = sum(out.values())
    return out


def learner_memory(config, tokens: int, zero_stage: int = 0, ranks: int = 1, cp: int = 1, bf16: bool = True,
                   checkpointing: bool = True, recompute_min_tokens: int = 0, compiled: bool = False,
                   recompute_layers: int | None = None, accumulating: bool = True) -> dict[str, int]:
    """Predicted peak bytes of one rank of a learner group of ``ranks`` ranks (ZeRO shards over all of them,
    data and context parallel alike: ``learner/dist.py``) training on packed rows of ``tokens`` tokens, each cut
    over ``cp`` context-parallel ranks; any HF causal-LM config. Marathon configs use `learner_memory_bytes`;
    other (dense) models the same state formula plus a transformer estimate of activations: saved layer inputs
    [T, D] with checkpointing (else ~10 D + 3 F values per token and layer), one layer's recompute and the
    chunked LM head as the transient; rows of fewer than ``recompute_min_tokens`` tokens per CP rank are not
    checkpointed, and on longer rows only the first ``recompute_layers`` layers (None: all; the others keep
    their activations); ``compiled`` (``learner.compile``) and ``accumulating`` (gradients held in the forward)
    apply to Marathon configs (other models' gradients are always counted). Keys as `learner_memory_bytes`."""
    if isinstance(config, MarathonConfig):
        return learner_memory_bytes(config, tokens, zero_stage, dp=ranks, cp=cp, bf16=bf16, checkpointing=checkpointing,
                                    recompute_min_tokens=recompute_min_tokens, compiled=compiled,
                                    recompute_layers=recompute_layers, accumulating=accumulating)
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        P = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    T, w = -(-tokens // cp), 2 if bf16 else 4
    D, L = config.hidden_size, config.num_hidden_layers
    k = checkpointed_layers(L, T, checkpointing, recompute_min_tokens, recompute_layers)
    F = getattr(config, "intermediate_size", 4 * D)
    states, step_grads = _states(P, zero_stage, ranks, bf16)
    out = {**states, "saved_activations": k * T * D * w + (L - k) * T * (10 * D + 3 * F) * w}
    out["transient"] = max(2 * T * (4 * D + 3 * F) * w, 3 * HEAD_CHUNK * config.vocab_size * 4 + T * D * w,
                           step_grads - out["saved_activations"])
    out["total"] = sum(out.values())
    return out
