"""kernels.allocator: a step's freed buffers stay in the process for the next step."""
import subprocess
import sys
from pathlib import Path

# Two 20 MB blocks written and freed, seven times: glibc's default gives the second block's pages back to the
# kernel each time (its free top passes twice the dynamic mmap threshold), so each round faults them in again.
ROUNDS = """
import ctypes, resource, sys
from raymoe.kernels.allocator import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
n = 20 << 20
def round_():
    a, b = libc.malloc(n), libc.malloc(n)
    libc.memset(a, 1, n)
    libc.memset(b, 1, n)
    libc.free(a)
    libc.free(b)
for _ in range(2):
    round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, setting], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    return int(out.stdout)


def test_freed_buffers_are_reused_without_page_faults():
    pages = 5 * 2 * (20 << 20) // 4096
    assert faults("default") > pages // 4          # what glibc does unset, here
    assert faults("keep") < pages // 100
