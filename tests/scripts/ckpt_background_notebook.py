"""``notebook_launcher`` of a function whose last line is ``save_state(blocking=False)``.

Usage: ckpt_background_notebook.py PROJECT MODE (modes of ckpt_background_end.py); prints the
launch error's class names, or "ok".
"""

import sys

from ckpt_background_end import main

from hasten import notebook_launcher

try:
    notebook_launcher(main, (sys.argv[1], sys.argv[2]), num_processes=2, use_port="0")
except Exception as exc:  # noqa: BLE001 - the test judges what was raised
    print("raised", [cls.__name__ for cls in type(exc).__mro__], str(exc)[-600:], flush=True)
else:
    print("ok", flush=True)
