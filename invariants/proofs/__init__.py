"""Proofs: Z3 theorems by subject, their runner, the production link, CrossHair.

| module            | what it holds                                                             |
|-------------------|---------------------------------------------------------------------------|
| `engine`          | steps, outcomes, the theorem registry; controls refute the stated claim   |
| `lemmas`          | arithmetic lemmas proved once over fresh integers, recorded at terms      |
| `swa_setup`       | the symbolic SWA group, its shared proof chains, claims on concrete values |
| `swa`             | SWA promises (segment ends, replay, junction) and no waste               |
| `swa_sparse`      | sparse against dense: never more, at most one interval less              |
| `eagle`           | Eagle / MTP: the peek block kept and served, the drop applied once       |
| `mamba`           | Mamba: one state per segment, promised states kept, checkpoint position  |
| `alignment`       | nothing cached past the aligned boundary, every hit aligned              |
| `validation`      | the validator accepts exactly what the promise proofs assume             |
| `queues`          | the free queue and pinned tier as a symbolic transition system           |
| `free_queue`      | free-queue order and pinned-tier theorems over `queues`                  |
| `runner`          | runs the catalogue in worker processes; the table                        |
| `production_link` | vLLM's mask and hit functions against the model, exhaustively (bounded)  |
| `coordinator_link`| vLLM's hybrid hit fixed point against `reconcile`, exhaustively (bounded) |
| `boundary_link`   | vLLM's replay boundaries and cacheable lengths against the model          |
| `crosshair`       | CrossHair contracts and twins                                            |

Every symbolic term a theorem uses is evaluated against the executable model
by a test; each subject module's docstring names the function and the test.
"""
