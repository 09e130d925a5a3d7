"""kvbuffer's tests, one folder per part of the package they test.

A package, so that the shared helpers import as `tests.support.<module>` from any folder and from
code run in a fresh interpreter (with the repository root on sys.path), and so that two test files of
the same name in different folders (engine/test_properties.py, reference/test_properties.py) do not
collide under pytest's default import mode.
"""
