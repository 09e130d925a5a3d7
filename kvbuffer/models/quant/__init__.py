"""FP8 checkpoints: the formats they declare (config), the FP8 arithmetic (fp8), the FP8 projections
(linear), loading them (load; the loader calls it) and writing them (write, which uses the loader and is
imported as kvbuffer.models.quant.write). docs/fp8.md says what is supported and how it runs."""
