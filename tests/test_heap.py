import subprocess
import sys

from kvguard import heap
from tests.helpers import kvguard_env

# A block of 8 MiB freed first raises glibc's own threshold above the blocks that follow; a small block kept after
# them pins the heap's top, so what the heap holds of them stays unless they were maps of their own.
PROBE = """
import ctypes, sys
from kvguard import heap
print(heap.settle() if sys.argv[1] == "settle" else None)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
big = libc.malloc(8 << 20)
ctypes.memset(big, 1, 8 << 20)
libc.free(ctypes.c_void_p(big))
before = rss()
blocks = [libc.malloc(heap.MMAP_THRESHOLD + 4096) for _ in range(64)]
pin = libc.malloc(64)
for b in blocks:
    ctypes.memset(b, 1, heap.MMAP_THRESHOLD)
held = rss() - before
for b in blocks:
    libc.free(ctypes.c_void_p(b))
print(held, rss() - before)
"""


def _run(mode: str, **env):
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env=kvguard_env(**env)).stdout.split("\n")
    return out[0], [int(x) for x in out[1].split()]


def test_settled_large_blocks_leave_the_process_when_freed_and_unsettled_ones_stay():
    settled, (held, after) = _run("settle")
    assert settled == "True" and held >= 32 * heap.MMAP_THRESHOLD and after < held / 8
    settled, (held, after) = _run("leave")
    assert settled == "None" and held >= 32 * heap.MMAP_THRESHOLD and after > held / 2  # glibc's own rule


def test_the_environment_settings_stand():
    assert _run("settle", MALLOC_MMAP_THRESHOLD_="262144")[0] == "False"
