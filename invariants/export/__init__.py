"""From a finding to upstream: a trace becomes a standalone vLLM pytest file and
an upstream report.

| module        | what                                                             |
|---------------|------------------------------------------------------------------|
| `plan`        | which property broke and its expected value from the model      |
| `pytest_file` | the pytest file in the style of vLLM's tests/v1/core            |
| `issue`       | the upstream report in Markdown                                  |
"""
