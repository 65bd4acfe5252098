"""The built-in task domains, one module each: `math`, `code` (hidden unit tests run by
`code_harness.py` in a sandbox), `docqa`, `terminal` (episodes driven by `terminal_driver.py`
in a sandbox) and `judge`; `answers` holds the explicit answer-extraction rules math and
docqa share. The protocol they implement is `reinforge.envs.domain`.
"""
