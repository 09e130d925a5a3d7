"""Engine options that `kvbuffer generate` and `kvbuffer serve` share, defined once."""

from __future__ import annotations

import click

compile_option = click.option(
    "--compile/--no-compile", "compile_", default=False, show_default=True,
    help="Run the decode and verify forwards under torch.compile: Inductor fuses the layers' small ops "
         "around kvbuffer's kernels (a faster step, minutes more start-up for a large model).")
