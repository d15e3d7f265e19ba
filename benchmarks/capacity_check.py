"""One check of the capacity prediction's batch scaling, cheaper than the 8 x 4,096 runs of
``kvguard eval --task capacity``: fit at 2 x 1,024 tokens, predict 8 x 1,024, measure 8 x 1,024 (each in a fresh
process).

    .venv/bin/python benchmarks/capacity_check.py kvguard     # the profile below; any static method or peer
"""
import sys
from kvguard.evaluation import capacity as c

method = sys.argv[1]
prof = "benchmarks/profiles/smollm2-135m-64"
fit = c.probe_subprocess("smollm2-135m", method, 2, 1024, 256, prof, "cpu")
fp = c.Footprint.from_probe(fit)
print(f"{method}: fit 2 x 1024: model {fp.model_rss / c.MIB:.0f} MiB, kv {fp.kv.intercept / c.MIB:.2f} MiB + "
      f"{fp.kv.slope:.1f} B/token, act {fp.act.intercept / c.MIB:.2f} MiB + {fp.act.slope:.1f} B/token per sequence; "
      f"predicted peak 8 x 1024: {fp.peak(8, 1024) / c.MIB:.0f} MiB", flush=True)
real = c.probe_subprocess("smollm2-135m", method, 8, 1024, 256, prof, "cpu")
print(f"{method}: measured peak 8 x 1024: {real['peak_rss'] / c.MIB:.0f} MiB (kv_bytes_ratio {real['kv_bytes_ratio']:.3f})",
      flush=True)
