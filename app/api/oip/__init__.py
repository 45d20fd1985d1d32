"""The Open Inference Protocol (KServe v2 REST, as Triton serves it) beside /predict, on its engine.

protocol.py the documents (pydantic), codec.py the bodies (the binary tensor extension),
catalog.py names and versions → training jobs, infer.py a request → /predict's engine → the answer,
stats.py the statistics extension, service.py the endpoints answered, routes.py served by the gate.
"""
