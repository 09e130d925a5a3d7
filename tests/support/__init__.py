"""Helpers shared by the tests, not tests themselves: problem families, outside oracles, tiny and
transformers models, serving schedules, a scripted drafter, the SIMT emulator and kernel test cases."""
