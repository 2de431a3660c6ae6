import sys, time, torch

sys.path.insert(0, "tests/gpu")
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner import prompt_lane as pl
from gpu_worker.runner.prefill_graphs import fill_prefill
from gpu_worker.runner.sampler import use_tail_kernel
from programs import get_spec, load_program_class
from tokenizer_worker.worker import wire_array

prog = load_program_class("qwen3-tts")(
    get_spec("qwen3-tts"), load_format="dummy", device="cuda", dtype=torch.bfloat16
)
prog.load_lm()
prog.fuse_layers()
use_tail_kernel("notail" not in sys.argv)
if "nopdl" in sys.argv:
    import flashinfer, flashinfer.utils, flashinfer.norm, flashinfer.activation, flashinfer.prefill

    off = lambda *a, **k: False
    for m in (flashinfer.utils, flashinfer.norm, flashinfer.activation, flashinfer.prefill):
        if hasattr(m, "device_support_pdl"):
            m.device_support_pdl = off
    import flashinfer.rope as fr

    print("rope pdl?", hasattr(fr, "device_support_pdl"), flush=True)
if "math" in sys.argv:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_kernel([SDPBackend.MATH]).__enter__()
import os

print(
    "env",
    {k: os.environ.get(k) for k in ("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "CUBLASLT_WORKSPACE_SIZE")},
    "args",
    sys.argv[1:],
)
if "unbiased" in sys.argv:
    proj = prog.lm.code_predictor.small_to_mtp_projection
    w, bias = proj.weight, proj.bias
    proj.forward = lambda x: torch.nn.functional.linear(x, w) + bias
    tp = prog.lm.text_projection
    print("text_projection", type(tp).__name__)
eng = Engine(prog, GpuWorkerSettings(max_batch_size=64, max_context=1024, prompt_lane="on"))
print("flags", sys.argv[1:], flush=True)
lane = eng.runner.lane
main = torch.cuda.current_stream()


def prompt(rid, text, seed, temperature, new=40):
    built = prog.preprocess(text, {})
    rows = built.rows.astype("<i4")
    sp = SamplingParams(
        temperature=temperature, top_k=50, seed=seed, max_tokens=len(rows) + new, min_tokens=new
    )
    return Prompt(
        rid, rows.tobytes(), len(rows), sp, state={k: wire_array(v) for k, v in built.state.items()}
    )


def generate(order):
    eng.outputs = {}
    for i, p in enumerate(order):
        eng.add(p)
        eng.lane_step()
        for _ in range(1 + i % 3):
            eng.step()
            eng.lane_step()
    while eng.has_work():
        eng.step()
        eng.lane_step()
    return {rid: rows for rid, (rows, _) in eng.outputs.items()}


def diffs(got, alone):
    return {
        rid: next((i for i, (a, b) in enumerate(zip(got[rid], alone[rid])) if a != b), None) for rid in alone
    }


orig = pl.PromptLane.launch


def make(prefill_on, sample_on):
    @torch.inference_mode()
    def launch(self, b, constrained):
        lay = self.prefill.layout(b)
        a = self.arena
        upto = a.spans[pl.LANE + "kv"][0] + len(lay.kv_indices)
        s1 = self.stream if prefill_on == "lane" else main
        s2 = self.stream if sample_on == "lane" else main
        with torch.cuda.stream(s1):
            if s1 is main:
                main.wait_stream(self.stream)  # the admission writes
            a.begin(upto)
            fill_prefill(a, b, lay, pl.LANE)
            a.host_view(pl.LANE + "meta").copy_(torch.from_numpy(b.meta.reshape(-1)))
            a.send(upto)
            self.prefill.plan(lay)
            a.seal()
            logits, hidden = self.prefill.replay(lay)
            self.logits.copy_(logits)
            self.hidden.copy_(hidden)
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            graph, out = self.samples[constrained]
            graph.replay()
            host = torch.empty(out.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return host, ready

    return launch


for temperature in (0.0, 0.9):
    order = [
        prompt(f"r{i}", f"Request {i} says a sentence of its own.", 10 + i, temperature) for i in range(6)
    ]
    alone = {}
    for p in order:
        alone |= generate([p])
    variants = [("as built", orig), ("as built again", orig)]
    if "full" in sys.argv:
        variants += [
            ("prefill lane, sampling main", make("lane", "main")),
            ("prefill main, sampling lane", make("main", "lane")),
        ]
    for label, fn in variants:
        pl.PromptLane.launch = fn
        before = eng.lane_prompts
        d = diffs(generate(order), alone)
        print(
            f"T={temperature} {label}: lane prompts {eng.lane_prompts - before}, first diffs {d}", flush=True
        )
    pl.PromptLane.launch = orig
