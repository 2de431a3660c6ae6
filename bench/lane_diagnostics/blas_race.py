import os, sys, torch

print(
    "torch",
    torch.__version__,
    "unified env",
    os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE"),
    "pref",
    torch.backends.cuda.preferred_blas_library(),
)
torch.manual_seed(0)
dev = "cuda"
shapes = [(1, 2048, 6144), (2, 6144, 2048), (1, 1024, 3072), (4, 3072, 1024), (2, 2048, 151936 // 16)]
xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16) for m, k, n in shapes]
ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for m, k, n in shapes]


def f():
    return [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)]


ref = [t.clone() for t in f()]


def cap(stream):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, stream=stream):
        out = f()
    return g, out


for label, mk in (
    ("same capture stream", lambda: None),
    ("own capture streams", lambda: torch.cuda.Stream(priority=-1)),
):
    a = cap(None)
    b = cap(mk())
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
    bad = 0
    for i in range(300):
        with torch.cuda.stream(sa):
            for _ in range(3):
                a[0].replay()
        with torch.cuda.stream(sb):
            for _ in range(3):
                b[0].replay()
        torch.cuda.synchronize()
        bad += sum(not torch.equal(o, r) for o, r in zip(a[1] + b[1], ref + ref))
    print(label, "mismatching outputs over 300 concurrent rounds:", bad)
