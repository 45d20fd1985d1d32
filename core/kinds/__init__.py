"""Job kinds, the API's side: for each kind its request (the spec POST takes), its typed params
(what the job record stores, decided once at submit) and that resolution, one module per kind,
named as its handler is on the worker's side (worker/kinds/<kind>.py reads the same params model
back). `request.py` is what POST /jobs accepts (train or predict); the submitters that check a
request against the world and create the job are core/submission.py (train; `Submitter`, the base
of all three), core/evaluations.py (evaluate) and core/batch_predict.py (predict); an export is
created by core/exports.py."""
