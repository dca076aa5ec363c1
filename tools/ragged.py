"""Ragged shapes for compute-sanitizer memcheck: every head dim, both masks, lengths that are not
tile multiples, GQA. Exits non-zero if any output is wrong."""
import torch

import kernelgen
from kernelgen.reference import attention_ref, max_error, rounding_allowance

bad = 0
for head_dim in (64, 96, 128, 192, 256):
    for causal in (False, True):
        for seqlen_q, seqlen_k in ((1, 1), (17, 33), (130, 77), (77, 130)):
            q = torch.randn(2, seqlen_q, 4, head_dim, device="cuda", dtype=torch.float16)
            k = torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.float16)
            v = torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.float16)
            out = kernelgen.flash_attn_func(q, k, v, causal=causal)
            ref, _ = attention_ref(q, k, v, causal)
            pt, _ = attention_ref(q, k, v, causal, upcast=False)
            if max_error(out, ref) > 2 * max_error(pt, ref) + rounding_allowance(ref):
                bad += 1
                print("WRONG", head_dim, causal, seqlen_q, seqlen_k)
torch.cuda.synchronize()
print(f"ragged: {bad} wrong")
raise SystemExit(1 if bad else 0)
