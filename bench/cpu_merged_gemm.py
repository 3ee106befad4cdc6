"""Merged q/k/v and gate/up GEMMs against separate ones on CPU (SmolLM2-135M shapes):
median, min, max microseconds per layer-worth of projections over 7 interleaved repeats."""
import torch, time, statistics, torch.nn.functional as F
torch.manual_seed(0)
h, q, kv, inter = 576, 576, 192, 1536
res = {}
for dtype in (torch.float32, torch.bfloat16):
  for bs in (1, 64):
    x = torch.randn(bs, h, dtype=dtype)
    wq, wk, wv = (torch.randn(n, h, dtype=dtype) for n in (q, kv, kv))
    wg, wu = torch.randn(inter, h, dtype=dtype), torch.randn(inter, h, dtype=dtype)
    wqkv = torch.cat([wq, wk, wv]); wgu = torch.cat([wg, wu])
    def sep():
        a = F.linear(x, wq); b = F.linear(x, wk); c = F.linear(x, wv)
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)
    def mer():
        a, b, c = F.linear(x, wqkv).split([q, kv, kv], -1)
        g, u = F.linear(x, wgu).chunk(2, -1)
        return F.silu(g) * u
    ts = {"sep": [], "mer": []}
    for rep in range(7):
        for name, fn in (("sep", sep), ("mer", mer)) if rep % 2 else (("mer", mer), ("sep", sep)):
            t = time.perf_counter()
            for _ in range(200): fn()
            ts[name].append((time.perf_counter() - t) / 200 * 1e6)
    print(dtype, bs, {k: (round(statistics.median(v), 1), round(min(v), 1), round(max(v), 1)) for k, v in ts.items()})
