"""The opt-in native build: `make compiled` compiles the hot pure modules with mypyc (`build`).

Which modules, and why each hot module left out stays pure Python, is `build.COMPILED` and
`build.EXCLUDED`; the choice at import to run the build or not is `invariants.compiled`.
"""
