"""Server-side Triton python models, copied into model repositories by `t5compress triton` (see each module).

They import numpy, onnxruntime, tokenizers, `triton_python_backend_utils` (the python backend's) and
`t5compress.runtime` (copied beside them), nothing else, so the server needs no t5compress install.
"""
