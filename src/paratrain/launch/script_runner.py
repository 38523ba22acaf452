"""Runs a user's script on one rank under ``paratrain launch``, as ``python SCRIPT ARGS`` would, and records
an uncaught exception in the agent's error file (``TORCHELASTIC_ERROR_FILE``).

The launcher then names the first failing rank with its exception type and message in its headline
(:mod:`paratrain.launch.failures`) for any script, without the script decorating its ``main`` with
:func:`paratrain.runtime.record_errors`. This file is started by path, not as a module, so nothing (torch
included) is imported before the script: a script may still set its environment before importing torch.
The full traceback is printed as Python would print it, and kept in the error file (``logs`` of the run).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback


def main() -> None:
    is_module = sys.argv[1] == "-m"
    target, args = (sys.argv[2], sys.argv[3:]) if is_module else (sys.argv[1], sys.argv[2:])
    sys.argv = [target, *args]
    if is_module:
        sys.path[0] = os.getcwd()  # as ``python -m``
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as ``python script.py``
    try:
        if is_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        raised_at = time.time()
        # as `python SCRIPT` prints it: from the script's first frame, without this runner's and runpy's
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (
            __file__,
            runpy.__file__,
            "<frozen runpy>",
        ):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb or e.__traceback__)
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if path and not os.path.exists(path):  # a script's own record_errors wrote it already
            from paratrain.runtime import _write_error_file

            _write_error_file(path, e, raised_at)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not a second traceback at interpreter exit, and no finalization to hang in


if __name__ == "__main__":
    main()
