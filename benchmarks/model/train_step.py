"""One bf16 training step (forward + backward) of a mid-size Marathon model on CUDA, at 4K and 32K tokens.

Run on the device machine: `python3 benchmarks/model/train_step.py [--ckpt]` (--ckpt: gradient checkpointing).
Results: benchmarks/model/results.md."""

import sys
import time

import torch

sys.path.insert(0, ".")
from model import MarathonConfig, MarathonForCausalLM  # noqa: E402

cfg = MarathonConfig.from_preset(
    "tiny", hidden_size=1024, num_hidden_layers=8, layer_layout="LLLG", linear_num_heads=16, linear_head_k_dim=64,
    linear_head_v_dim=64, mla_num_heads=16, num_attention_heads=16, num_key_value_heads=4, n_routed_experts=64,
    num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=4096, attn_residual_block_size=4,
    vocab_size=32000,
)
torch.manual_seed(0)
m = MarathonForCausalLM(cfg).cuda().to(torch.bfloat16).train()
if "--ckpt" in sys.argv:
    m.gradient_checkpointing_enable()
print("params", m.parameter_counts())
for T in (4096, 32768):
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, 32000, (1, T), device="cuda")
    for _ in range(2):  # the second step is timed
        torch.cuda.synchronize()
        t = time.time()
        m(ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        dt = time.time() - t
    print(f"T={T} fwd+bwd {dt * 1e3:.1f} ms  {T / dt / 1e3:.1f} Ktok/s  "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
