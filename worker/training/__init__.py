"""A training run on one device or one rank: the plan and the loop (trainer.py), one optimizer step
(train_step.py), the recipe, resume state, the shapes tuned before the first epoch
(shape_tuning.py), augmentation, out-of-memory back-off, evaluation, starting weights and where the
batches live (staging.py). Nothing is imported here: a room's modules are imported by name."""
