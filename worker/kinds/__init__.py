"""Job kinds, the worker's side: one handler per kind (`run_<kind>_job(job, ctx)`), each in the
module named as its kind's package is on the API's side (core/kinds/<kind>/, whose params model
it reads the job's `params` back into). worker/job_runner.py picks the handler by the job's kind."""
