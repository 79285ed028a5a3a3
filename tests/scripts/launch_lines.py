"""Every rank prints LINES lines to stdout and to stderr at the same moment, each line with one
`print(a, b, c)` (several writes per line under `python -u`). Usage: launch_lines.py LINES

Then a line with a newline inside an argument, and rank 0 ends with text that has no newline.
"""

import sys

from hasten import Accelerator

accelerator = Accelerator(cpu=True)
lines, rank = int(sys.argv[1]), accelerator.process_index
accelerator.wait_for_everyone()  # both ranks print at once
for i in range(lines):
    print(f"rank {rank} out {i}", "x" * (i % 50), "end")
    print(f"rank {rank} err {i}", "y" * (i % 50), "end", file=sys.stderr)
print(f"rank {rank} two\nrank {rank} lines", "end")
accelerator.wait_for_everyone()
if rank == 0:
    print("rank 0 no newline at exit", end="")
