"""What a job leaves for a later delivery, for /predict and for users: the checkpoint format
(format.py), a checkpoint's forward as one traced graph (forward_graph.py, and thread_warnings.py
for its trace's warnings), and a batch prediction's results file with its resume point
(batch_predict_results.py). Nothing is imported here: a room's modules are imported by name."""
