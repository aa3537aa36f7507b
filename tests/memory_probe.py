"""Run in a subprocess by the memory tests: load a checkpoint (``mxfp4x``: through
mxfp4x.integrations.transformers; ``transformers``: its own loader), run one forward of 16
tokens, print one JSON line: RSS before the imports, after the forward, the peak, and the
bytes of the experts' tensors. ``python memory_probe.py PATH MODE [DTYPE]``; the tests call
:func:`measure`."""
import json
import os
import resource
import subprocess
import sys
import warnings


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """VmHWM: this process image's peak RSS (ru_maxrss would carry over the peak of the
    process that forked it, e.g. a large pytest)."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def main(path: str, mode: str, dtype: str = "float32") -> None:
    before = rss()
    import torch

    warnings.simplefilter("ignore")
    kwargs = dict(dtype=getattr(torch, dtype))
    if mode == "mxfp4x":
        import mxfp4x.integrations.transformers as mxt
        model = mxt.from_pretrained(path, **kwargs)
    else:
        import transformers
        quant = getattr(transformers.AutoConfig.from_pretrained(path), "quantization_config",
                        None) or {}
        if quant.get("quant_method") == "mxfp4":  # dequantized, as on a CPU, even where
            # Triton is installed (transformers would then fetch kernels from the Hub)
            kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with torch.no_grad():
        model(torch.arange(16).reshape(1, 16))
    experts = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                  if ".experts." in n)
    print(json.dumps({"peak": peak_rss(),
                      "experts": experts, "before": before, "after": rss()}))


def measure(path, mode, dtype="float32"):
    """memory_probe.py's figures for loading ``path`` in a fresh process."""
    probe = os.path.abspath(__file__)
    run = subprocess.run([sys.executable, probe, str(path), mode, dtype],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def report(found):
    for k, d in found.items():
        mib = {q: v / 2**20 for q, v in d.items()}
        print(f"\n{k}: RSS {mib['before']:.0f} MiB before the imports, {mib['after']:.0f} MiB "
              f"after load and one forward, peak {mib['peak']:.0f} MiB; experts "
              f"{mib['experts']:.0f} MiB")


if __name__ == "__main__":
    main(*sys.argv[1:])
