"""The code-interpreter image and the service it runs (E2B ``e2b_code_interpreter``)."""
