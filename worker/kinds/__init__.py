"""Job kinds, the worker's side: one handler per kind (`run_<kind>_job(job, ctx)`), each in the
module named as its kind is on the API's side (core/kinds/<kind>/, whose params model it reads the job's `params` back
into): train.py, evaluate.py, batch_predict.py (the kind whose wire value is `predict`; "predict"
alone is /predict, worker/serving/), export.py. worker/runtime/job_runner.py picks the handler by
the job's kind."""
