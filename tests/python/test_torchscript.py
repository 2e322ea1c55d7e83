"""TorchScript: script a model that uses the public API, run it from C++ (kvcache_run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings

import pytest
import torch

import kvcache
from kvcache.models import Decoder, StatefulDecoder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = kvcache.TransformerConfig(num_layers=2, num_heads=8, d_model=64, max_len=32, num_kv_heads=2)


def script(module):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated in recent torch
        return torch.jit.script(module)


def find_or_build_runner() -> str:
    """KVCACHE_RUNNER (scripts/test.sh sets it), or kvcache_run built with CMake
    against the running torch in build/runner-<torch version>/ (rebuilt when its sources changed; linked
    to the imported package's libkvcache.so: only the runner's source compiles).

    Fails showing cmake's output when the build fails; skips when cmake (or,
    for a CUDA torch, the CUDA toolkit its CMake config needs) is missing.
    """
    import glob

    def cuda_args():
        # TorchConfig.cmake of a CUDA torch requires the CUDA toolkit ("Your
        # installed Caffe2 version uses CUDA but I cannot find the CUDA
        # libraries") and links nvrtc, which ships in the nvidia-* wheels, not
        # in the toolkit: found as scripts/check_cuda_build.sh does. The runner
        # gets no CUDA kernels (it runs on CPU here, and builds faster).
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if not home:
            if os.path.exists("/usr/local/cuda/bin/nvcc"):
                home = "/usr/local/cuda"  # /usr/local/bin/nvcc may be a wrapper script
            elif shutil.which("nvcc"):
                home = os.path.dirname(os.path.dirname(os.path.realpath(shutil.which("nvcc"))))
        if not home or not os.path.exists(os.path.join(home, "bin", "nvcc")):
            pytest.skip(f"torch {torch.__version__} has CUDA: building kvcache_run against it needs "
                        "the CUDA toolkit (nvcc; set CUDA_HOME), which is not installed")
        # CUDAToolkit_ROOT for FindCUDAToolkit, CUDA_TOOLKIT_ROOT_DIR for the FindCUDA that
        # torch's cuda.cmake still uses (else it takes /usr/local/bin/nvcc's folder).
        args = [f"-DCUDAToolkit_ROOT={home}", f"-DCUDA_TOOLKIT_ROOT_DIR={home}",
                f"-DCMAKE_CUDA_COMPILER={home}/bin/nvcc", "-DKVCACHE_CUDA=OFF"]
        try:
            import nvidia

            nvrtc = sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], "**", "libnvrtc.so*"), recursive=True))
        except ImportError:
            nvrtc = []
        return args + [f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}"] if nvrtc else args

    def run(args, what):
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:  # show why: cmake's own error is on stderr
            pytest.fail(f"{what} failed ({' '.join(args)}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")

    if os.environ.get("KVCACHE_RUNNER"):
        return os.environ["KVCACHE_RUNNER"]
    # One folder per torch: a runner linked against another torch must not be reused.
    build = os.path.join(ROOT, "build", f"runner-{torch.__version__}")
    path = os.path.join(build, "kvcache_run")
    if shutil.which("cmake") is None:
        if os.path.exists(path):
            return path
        pytest.skip("cmake is not installed: cannot build kvcache_run")
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        # The runner links the library this process imported (through its package config): one
        # source file to compile, not the whole library again.
        package = os.path.dirname(os.path.abspath(kvcache.__file__))
        args = ["cmake", "-S", ROOT, "-B", build, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                "-DKVCACHE_BUILD_TESTS=OFF", f"-DKVCACHE_PREBUILT_PACKAGE={package}"]
        if torch.version.cuda is not None:
            args += cuda_args()
        run(args, "configuring kvcache_run")
    # Built every time (a no-op when up to date): a runner from older sources is not reused.
    run(["cmake", "--build", build, "--target", "kvcache_run", "-j", str(os.cpu_count() or 1)],
        "building kvcache_run")
    return path


def eager_generate(model, prompt, new_tokens):
    """The loop kvcache_run runs, in eager Python."""
    step = StatefulDecoder(model, batch_size=prompt.shape[0])
    with torch.inference_mode():
        logits = step(prompt)
        last = logits[:, -1]
        tokens, chosen = [], []
        for i in range(new_tokens):
            tok = last.argmax(-1)
            tokens.append(tok)
            chosen.append(last)
            if i + 1 == new_tokens:
                break
            last = step(tok[:, None])[:, 0]
    return torch.stack(tokens, 1), torch.stack(chosen, 1)


def test_public_api_scripts():
    scripted = script(kvcache.update_kv_layer_cache)
    assert "kvcache::update_" in str(scripted.graph)
    for fn, op in ((kvcache.append_kv_layer_cache, "kvcache::append_"), (kvcache.attend, "kvcache::attend")):
        assert op in str(script(fn).graph)


def test_scripted_module_matches_eager(tmp_path):
    model = Decoder(CFG, seed=5).eval()
    prompt = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    scripted = script(StatefulDecoder(model, batch_size=2))
    path = tmp_path / "model.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    eager = StatefulDecoder(model, batch_size=2)
    with torch.no_grad():
        assert torch.equal(loaded(prompt), eager(prompt))
        tok = prompt[:, :1]
        assert torch.equal(loaded(tok), eager(tok))
        loaded.reset()
        eager.reset()
        assert torch.equal(loaded(prompt), eager(prompt))


def test_cpp_runner_roundtrip_bit_exact(tmp_path):
    runner = find_or_build_runner()
    model = Decoder(CFG, seed=5).eval()
    prompt = torch.randint(0, CFG.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    new_tokens = 10
    script(StatefulDecoder(model, batch_size=2)).save(str(tmp_path / "model.pt"))
    torch.save(prompt, tmp_path / "prompt.pt")
    out = tmp_path / "out.pt"
    proc = subprocess.run(
        [runner, str(tmp_path / "model.pt"), str(tmp_path / "prompt.pt"), str(new_tokens), str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    tokens, logits = torch.load(out)
    ref_tokens, ref_logits = eager_generate(model, prompt, new_tokens)
    assert tokens.shape == (2, new_tokens) and logits.shape == (2, new_tokens, CFG.vocab_size)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)  # bit-exact in float32 on CPU


def test_cpp_runner_reports_bad_input(tmp_path):
    runner = find_or_build_runner()
    proc = subprocess.run([runner, "nope.pt", "nope.pt", "3", str(tmp_path / "o.pt")], capture_output=True, text=True)
    assert proc.returncode != 0 and "kvcache_run:" in proc.stderr
    proc = subprocess.run([runner], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
