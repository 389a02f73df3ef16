"""Tree requests in vLLM: a request names a tree in `extra_args` (args.py: names, the server-wide
tree, the request format), the front end admits it (admission.py, large ones parsed in a process of
their own: admission_process.py), and the engine compiles it (compile.py, large ones parsed in
the engine core's own admission process) and decodes it as a structured-output grammar
(grammar.py), through the tree route's rows of the patch table (route.py).
"""
