"""Qwen3-Omni end to end on one device (issue 59): chat prompts in, text and speech out
through the three stages (``OmniPipeline``: thinker -> talker -> Code2Wav), at C
concurrent requests, in two arms on one loaded pipeline, interleaved: ``streamed`` (the
talker starts after the thinker's first two tokens and is fed as it writes) and
``in_order`` (the talker starts once the thinker's reply is complete).

Weights are random (bf16), drawn on the device from a folder holding only config.json and
random_weights.json (the released checkpoint, 61 GB, does not fit beside anything on the
GPU machine's disk): the thinker at Qwen3-Omni-30B-A3B's text shape (48 MoE layers,
hidden 2048, 128 experts top-8 of 768, vocabulary 152,064), the talker and code predictor
at transformers' defaults (20 MoE layers, hidden 1024) with the released codec ids and 16
codebooks, Code2Wav at its defaults (16 quantizers, 24 kHz). Each request: a chat prompt
of ``--prompt`` tokens (system and user turns, the assistant's start), ``--reply`` text
tokens (greedy, EOS ignored) and ``--frames`` frames of speech (12.5 a second; a random
talker rarely writes its EOS).

``--requests-per-stream R`` (default 1: C requests started together, all measured, the
burst) makes each of the C clients ask for R replies in turn (a closed loop, as
``bench/tts_serving.py`` and vLLM-Omni's serving benchmark run): the first C replies to
end are left out, and figures are those of the steady state after them.

Prints one JSON line per (arm, concurrency): wall s; TTFT (submission to the first text
delta) and TTFP (to the first audio chunk) p50/p90 ms; RTF p50/p90 (submission to the
last audio chunk over the audio's length); TTFP's parts (p50: submission to the talker's
request, that to the first chunk); audio-s/s (all audio over the wall); C50 / C100 / C200
(the share of streams whose worst gap is <= 50 / 100 / 200 ms as the project's reference
player hears them, ``Playback``: each chunk played in real time from the first one's
arrival; before 2026-12-07 this bench's C100 counted a stream only with no gap at all, of
any length) with the worst gaps' p50 and max; underruns (chunks that came after the audio
before them ran out) and, over the streams that stalled, where the first stall fell (p50 of
its ms after the first chunk, of the audio sent before it and of the reply's text tokens by
then: early, with text still coming, the talker waited for the thinker; late, the talker and
codec fell behind the listener); GPU busy % (NVML, when pynvml imports); peak device memory (torch's
tensors, GB; and the whole process as NVML sees it, GiB). Saves the JSON
to ``--out``.

``--repeats N`` (default 1) runs every (concurrency, arm) level N times on the one
pipeline, built and warmed once, interleaved (repeat 0 of every concurrency and arm, then
repeat 1, ...), each repeat a fresh burst of new prompts: one burst of 64 is too noisy to
tell two commits apart (TTFP p50 1.1 s against 1.9 s, C100 0% against 100%, for one
commit in two leases). Each run's line carries its ``repeat``; all runs stay in the JSON's
``levels``. After the runs a table, saved as the JSON's ``summary`` (one entry per arm and
concurrency), gives the median and [min-max] over the repeats of TTFP p50, RTF p50,
audio-s/s, C100, underruns and the worst gaps' p50; compare commits by the medians, and
take a difference inside both ranges as noise.

    python bench/omni_serving.py --device cuda --concurrency 1,8,32,64 --out bench/results/omni_serving.json
    python bench/omni_serving.py --device cuda --concurrency 64 --repeats 3   # 3 bursts, median and range
    python bench/omni_serving.py --device cuda --concurrency 64 --requests-per-stream 3   # the steady state
    python bench/omni_serving.py --smoke --repeats 2   # CPU, a tiny config: checks the script runs
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GpuSampler  # noqa: E402

from omni_async import SamplingParams  # noqa: E402
from omni_async.models.random_weights import RANDOM_WEIGHTS_FILE  # noqa: E402
from omni_async.speech.omni_pipeline import OmniPipeline  # noqa: E402
from omni_async.speech.playback import Playback  # noqa: E402

# The released ids the defaults lack (codec ids as Qwen3-TTS 12 Hz's; speakers within the
# talker's 3,072-id vocabulary).
CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                 codec_think_bos_id=2156, codec_think_eos_id=2157)
_IDS = itertools.count()
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
THINKER = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
               mlp_only_layers=[], vocab_size=152064, max_position_embeddings=65536)
TALKER = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=384, shared_expert_intermediate_size=2048,
              head_dim=128)
SMOKE_THINKER = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     mlp_only_layers=[], vocab_size=152064, max_position_embeddings=4096)
SMOKE_TALKER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
SMOKE_PREDICTOR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16)
SMOKE_CODE2WAV = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1, decoder_dim=32,
                      intermediate_size=64, sliding_window=8)


def make_folder(folder: Path, smoke: bool) -> Path:
    """config.json (a Qwen3-Omni config: the shapes above) and random_weights.json."""
    from transformers import Qwen3OmniMoeConfig

    raw = Qwen3OmniMoeConfig().to_dict()
    raw["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    raw["dtype"] = "bfloat16"
    raw["thinker_config"]["text_config"].update(SMOKE_THINKER if smoke else THINKER)
    t = raw["talker_config"]
    t.update(CODEC_IDS, speaker_id=SPEAKERS, accept_hidden_layer=2 if smoke else 18, num_code_groups=16,
             thinker_hidden_size=raw["thinker_config"]["text_config"]["hidden_size"])
    t["text_config"].update(SMOKE_TALKER if smoke else TALKER)
    # The audio tower writes rows of the thinker's width (the released 30B-A3B's: 2,048).
    raw["thinker_config"]["audio_config"]["output_dim"] = raw["thinker_config"]["text_config"]["hidden_size"]
    t["code_predictor_config"].update(num_code_groups=16, **(SMOKE_PREDICTOR if smoke else {}))
    if smoke:
        raw["code2wav_config"].update(SMOKE_CODE2WAV)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=1))
    (folder / RANDOM_WEIGHTS_FILE).write_text(json.dumps({"seed": 0, "std": 0.02}))
    return folder


def chat_prompt(raw: dict, length: int, rng: random.Random) -> list[int]:
    """``length`` ids: a system turn, a user turn of random ids, the assistant's start."""
    start, end, nl = raw["im_start_token_id"], raw["im_end_token_id"], 198
    head = [start, raw["system_token_id"], nl, *(rng.randint(1000, 100000) for _ in range(8)), end, nl, start, raw["user_token_id"], nl]
    tail = [end, nl, start, raw["assistant_token_id"], nl]
    return head + [rng.randint(1000, 100000) for _ in range(max(1, length - len(head) - len(tail)))] + tail


@dataclass
class Stream:
    """One request's clock: when its text came, when its talker request went in, and its
    audio as the project's reference player (``Playback``) hears it."""

    start: float
    first_text: float | None = None
    talker_in: float | None = None
    last_audio: float | None = None
    player: Playback = field(default_factory=Playback)
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival, seconds of audio)
    text_tokens: int = 0  # the reply's text tokens so far
    # The first stall: (ms after the first chunk, seconds of audio sent before it, the
    # reply's text tokens by then): early after the first chunk with the text still
    # coming says the talker ran out of the thinker's text; late, with the text done,
    # that the talker and codec fell behind the listener.
    first_stall: tuple[float, float, int] | None = None

    def on_audio(self, now: float, seconds: float) -> None:
        stalls = self.player.underruns
        sent = self.player.sent_s
        self.player.on_audio(seconds, now)
        if self.first_stall is None and self.player.underruns > stalls:
            self.first_stall = (1000 * (now - self.player.first_audio_at), sent, self.text_tokens)
        self.chunks.append((now, seconds))
        self.last_audio = now


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def level(pipe: OmniPipeline, prompts: list[list[int]], args: argparse.Namespace, clients: int | None = None) -> dict:
    """``clients`` closed-loop clients (default: one per prompt, all started together)
    through ``prompts``; with more prompts than clients, the first ``clients`` replies to
    end (the burst the clients start with) are left out, and the clock starts when they
    have ended (audio-s/s counts the audio that came after it)."""
    sampling = SamplingParams(max_new_tokens=args.reply, temperature=0.0, ignore_eos=True)
    clients = clients or len(prompts)
    warmup = clients if len(prompts) > clients else 0
    streams: dict[str, Stream] = {}
    ended: list[Stream] = []
    queue = list(prompts)
    submit = pipe.talker.engine.submit

    async def talker_submit(*a, **kw):  # when each reply's talker request goes in
        stream = streams.get(kw.get("request_id", ""))
        if stream is not None:
            stream.talker_in = time.perf_counter()
        return await submit(*a, **kw)

    async def one(prompt: list[int]) -> Stream:
        rid = f"omni-bench-{next(_IDS)}"
        s = streams[rid] = Stream(time.perf_counter())
        s.player.created = s.start
        async for d in pipe.stream(input_ids=prompt, voice="ethan", sampling=sampling, max_frames=args.frames, request_id=rid):
            now = time.perf_counter()
            if d.kind == "text" and d.token_ids:
                s.first_text = now if s.first_text is None else s.first_text
                s.text_tokens += len(d.token_ids)
            elif d.kind == "audio" and d.audio is not None and len(d.audio.audio):
                s.on_audio(now, d.audio.seconds)
        return s

    async def client() -> None:
        while queue:
            ended.append(await one(queue.pop(0)))
            if len(ended) == warmup:
                clock[0] = time.perf_counter()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    passes, served = pipe.input.passes, pipe.input.replies_served
    prompt_passes, prompts_built = pipe.input.prompt_passes, pipe.input.prompts_built
    pipe.talker.engine.submit = talker_submit
    try:
        with GpuSampler() as sampler:
            clock = [time.perf_counter()]
            await asyncio.gather(*(client() for _ in range(clients)))
            wall = time.perf_counter() - clock[0]
    finally:
        del pipe.talker.engine.submit
    audio = sum(sec for s in streams.values() for t, sec in s.chunks if t >= clock[0])
    done = ended[warmup:]
    ms = lambda a, b: [1000 * (b(s) - a(s)) for s in done if a(s) is not None and b(s) is not None]  # noqa: E731
    ttft = ms(lambda s: s.start, lambda s: s.first_text)
    ttfp = ms(lambda s: s.start, lambda s: s.player.first_audio_at)
    # TTFP in its parts: the thinker to the talker's start, the talker and the codec to the first chunk
    to_talker = ms(lambda s: s.start, lambda s: s.talker_in)
    talker_to_audio = ms(lambda s: s.talker_in, lambda s: s.player.first_audio_at)
    rtf = [(s.last_audio - s.start) / s.player.sent_s for s in done if s.last_audio is not None and s.player.sent_s]
    gaps = [1000 * s.player.worst_gap_s for s in done if s.player.first_audio_at is not None]
    stalls = [s.first_stall for s in done if s.first_stall is not None]
    share = lambda limit: round(sum(1 for g in gaps if g <= limit) / len(done), 3)  # noqa: E731
    return {
        "streams": clients, "requests": len(done), "left_out": warmup, "wall_s": round(wall, 3),
        "ttft_p50_ms": _r(quantile(ttft, 0.5)), "ttft_p90_ms": _r(quantile(ttft, 0.9)),
        "ttfp_p50_ms": _r(quantile(ttfp, 0.5)), "ttfp_p90_ms": _r(quantile(ttfp, 0.9)),
        "to_talker_p50_ms": _r(quantile(to_talker, 0.5)), "talker_to_audio_p50_ms": _r(quantile(talker_to_audio, 0.5)),
        "rtf_p50": _r(quantile(rtf, 0.5), 3), "rtf_p90": _r(quantile(rtf, 0.9), 3),
        "audio_s_per_s": round(audio / wall, 2), "audio_s": round(audio, 2),
        # C50 / C100 / C200: the share of streams whose worst gap is <= 50 / 100 / 200 ms (bench/tts_serving.py's)
        "c50": share(50), "c100": share(100), "c200": share(200),
        "worst_gap_p50_ms": _r(quantile(gaps, 0.5)), "worst_gap_max_ms": _r(max(gaps, default=None)),
        "underruns": sum(s.player.underruns for s in done),
        # where the first stall fell (streams that stalled): p50 of its time after the first
        # chunk, of the audio sent before it and of the reply's text tokens by then
        "stalled_streams": len(stalls),
        "first_stall_after_ms_p50": _r(quantile([x[0] for x in stalls], 0.5)),
        "first_stall_audio_s_p50": _r(quantile([x[1] for x in stalls], 0.5), 3),
        "first_stall_text_tokens_p50": quantile([x[2] for x in stalls], 0.5),
        "gpu_busy_pct": sampler.busy(),
        # the talker's text rows: requests for them, and the passes that built them (omni_input)
        "text_row_requests": pipe.input.replies_served - served, "text_row_passes": pipe.input.passes - passes,
        "talker_prompts": pipe.input.prompts_built - prompts_built, "talker_prompt_passes": pipe.input.prompt_passes - prompt_passes,
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,  # torch's tensors
        # the whole process as NVML sees it (the CUDA context, the libraries' workspaces, torch's pool)
        "peak_process_memory_gib": round(sampler.peak_bytes / 2**30, 2) if sampler.peak_bytes else None,
    }


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


# The figures the summary gives over the repeats: (key, the table's heading).
SUMMARY = (("ttfp_p50_ms", "TTFP p50 ms"), ("rtf_p50", "RTF p50"), ("audio_s_per_s", "audio-s/s"), ("c100", "C100"),
           ("underruns", "underruns"), ("worst_gap_p50_ms", "worst gap p50 ms"))


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (concurrency, arm), in the order the levels first ran: the runs'
    count and each of ``SUMMARY``'s figures as {median, min, max} over the runs that have
    it (None when none has)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["streams"], row["arm"]), []).append(row)
    out = []
    for (streams, arm), runs in groups.items():
        entry: dict = {"arm": arm, "streams": streams, "runs": len(runs)}
        for key, _ in SUMMARY:
            values = [run[key] for run in runs if run.get(key) is not None]
            entry[key] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)} if values else None
        out.append(entry)
    return out


def summary_table(summary: list[dict]) -> str:
    """``summarize``'s entries as a plain-text table: median [min-max] a cell."""
    def cell(figure: dict | None) -> str:
        if figure is None:
            return "-"
        if figure["min"] == figure["max"]:
            return f"{figure['median']:g}"
        return f"{figure['median']:g} [{figure['min']:g}-{figure['max']:g}]"

    head = ["arm", "C", "runs", *(title for _, title in SUMMARY)]
    body = [[e["arm"], str(e["streams"]), str(e["runs"]), *(cell(e[key]) for key, _ in SUMMARY)] for e in summary]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in [head, *body])


async def main_async(args: argparse.Namespace, folder: Path) -> dict:
    raw = json.loads((folder / "config.json").read_text())
    # Every stage's KV sized, not the device's free memory: the thinker loads first and
    # would leave the talker and the codec nothing.
    limits = dict(max_running_requests=max(64, max(args.concurrency)))
    pipe = OmniPipeline.from_pretrained(folder, device=args.device, loop=args.loop, dtype=args.dtype,
                                        codec_graphs={"on": True, "off": False}[args.codec_graphs],
                                        thinker_limits={**limits, "kv_capacity_tokens": args.thinker_kv_tokens},
                                        talker_limits={**limits, "kv_capacity_tokens": args.talker_kv_tokens})
    rng = random.Random(0)
    rows = []
    async with pipe:
        warm = argparse.Namespace(**{**vars(args), "reply": 4, "frames": 4})
        for arm in args.arms:  # warm-up: every stage's first calls
            pipe.stream_talker = arm == "streamed"
            await level(pipe, [chat_prompt(raw, args.prompt, rng)], warm)
        # Repeats interleaved: every level's repeat r before any level's r + 1, each a fresh
        # burst of new prompts on the same warmed pipeline.
        for repeat in range(args.repeats):
            for c in args.concurrency:
                prompts = [chat_prompt(raw, args.prompt, rng) for _ in range(c * args.requests_per_stream)]
                for arm in args.arms:
                    pipe.stream_talker = arm == "streamed"
                    row = {"arm": arm, "repeat": repeat, **await level(pipe, prompts, args, c)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = summarize(rows)
    print(f"\nover {args.repeats} repeat(s): median [min-max]\n" + summary_table(summary), flush=True)
    return {"benchmark": "omni_serving", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": platform.node(),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(), "torch": torch.__version__,
            "config": {k: v for k, v in vars(args).items()}, "levels": rows, "summary": summary}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--loop", default="overlap")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    ap.add_argument("--arms", type=lambda s: s.split(","), default=["streamed", "in_order"])
    ap.add_argument("--requests-per-stream", type=int, default=1,
                    help="replies each of the C clients asks for in turn (1: C started together, all measured; more: "
                         "a closed loop, the first C to end left out, the steady state measured)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every (concurrency, arm) level, interleaved, each a fresh burst on the one warmed pipeline; "
                         "a summary gives each figure's median and [min-max] over them")
    ap.add_argument("--prompt", type=int, default=100, help="chat prompt tokens")
    ap.add_argument("--reply", type=int, default=100, help="text tokens a reply")
    ap.add_argument("--frames", type=int, default=125, help="speech frames a reply (10 s)")
    ap.add_argument("--codec-graphs", choices=["on", "off"], default="on", help="the codec's calls as CUDA graphs")
    ap.add_argument("--thinker-kv-tokens", type=int, default=32768, help="the thinker's KV capacity (64 x 200 tokens fit)")
    ap.add_argument("--talker-kv-tokens", type=int, default=32768, help="the talker's KV capacity")
    ap.add_argument("--folder", default=None, help="where config.json and random_weights.json go (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny config, few tokens: checks the script runs")
    ap.add_argument("--out", default="bench/results/omni_serving.json")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.smoke:
        args.device, args.dtype, args.concurrency, args.prompt, args.reply, args.frames = "cpu", "float32", [1, 3], 40, 8, 6
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_folder(Path(args.folder or tmp) / "qwen3-omni-random", args.smoke)
        result = asyncio.run(main_async(args, folder))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("saved", args.out)


if __name__ == "__main__":
    main()
