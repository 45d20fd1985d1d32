"""The guards the mutation pass breaks (scripts/mutation.py), one line each, and the tests that must
catch the break saying what broke.

Each entry: the file, the exact line as it is (stripped; `nth` picks among identical lines), the
line a plausible slip would leave instead, the tests (pytest node ids) that must then fail, and
`says`: text the failure's output must hold, the assertion that names the broken behaviour (a
test that fails on a decode error or a timeout for this mutation has not caught it for the right
reason). When a guarded line changes, its entry must change with it: the pass refuses an entry
whose line it cannot find exactly once.

`group` "earlier" are the kinds of guard an earlier round of hand mutations tried (fencing, the
claim and step checks, the owner's renewal, the attempts limit, the API key, zip-slip, the
/predict budget and image limits, early stopping, weights_only, and the three that then slipped
through: the sweep after an outage, the lease re-checked at redelivery, Idempotency-Key); "edges"
and the rest came with the tests that pin them (docs/reliability.md, "The mutation pass").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Guard:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    says: str
    group: str = "earlier"
    nth: int = 0  # which of several identical lines (0: the first)


JOBS = "tests/core/test_jobs.py"
HEARTBEAT = "tests/worker/runtime/test_heartbeat.py"

GUARDS: tuple[Guard, ...] = (
    # ---------------------------------------------------------------- fencing, claim, lease, attempts
    Guard("fenced write checks the delivery token", "core/jobs/delivery.py",
          "if current[1] ~= 'running' or current[2] ~= ARGV[1] then return 0 end",
          "if current[1] ~= 'running' then return 0 end",
          (f"{JOBS}::test_a_stale_delivery_changes_nothing",), "DID NOT RAISE"),
    Guard("only the owner renews the lease", "core/jobs/delivery.py",
          "if current[1] ~= 'running' or current[2] ~= ARGV[1] then return 0 end",
          "if current[1] ~= 'running' then return 0 end",
          (f"{JOBS}::test_a_stale_delivery_changes_nothing",
           f"{JOBS}::test_expired_lease_is_redelivered_with_a_new_token_then_fails"), "renew_lease", nth=1),
    Guard("the step check sees a lost lease", "core/jobs/delivery.py",
          "if status != JobStatus.running.value or delivery != token:",
          "if status != JobStatus.running.value:",
          (f"{JOBS}::test_cancel_running_is_seen_by_the_step_check",
           f"{JOBS}::test_expired_lease_is_redelivered_with_a_new_token_then_fails"), "lease_lost"),
    Guard("an epoch is recorded by the owner only", "core/jobs/delivery.py",
          "if status != JobStatus.running.value or delivery != token:",
          "if status != JobStatus.running.value:",
          (f"{JOBS}::test_a_stale_delivery_changes_nothing",), "DID NOT RAISE", nth=1),
    Guard("finish is fenced by the token", "core/jobs/delivery.py",
          "if delivery != token:", "if delivery is None:",
          (f"{JOBS}::test_a_stale_delivery_changes_nothing",
           f"{JOBS}::test_expired_lease_is_redelivered_with_a_new_token_then_fails"), "store.finish"),
    Guard("a claim needs the current delivery token", "core/jobs/delivery.py",
          'if raw.get("delivery") != token:', 'if raw.get("delivery") is None:',
          (f"{JOBS}::test_lifecycle_and_events",), "stale-token"),
    Guard("a running job is never claimed twice", "core/jobs/delivery.py",
          "if status is not JobStatus.queued:", "if status is JobStatus.succeeded:",
          (f"{JOBS}::test_lifecycle_and_events",), "never twice"),
    Guard("a job fails after max_attempts deliveries", "core/jobs/recovery.py",
          "if attempts >= self.max_attempts:", "if attempts > self.max_attempts:",
          (f"{JOBS}::test_expired_lease_is_redelivered_with_a_new_token_then_fails",
           f"{JOBS}::test_requeue_is_fenced_and_bounded"), "gave up after"),
    Guard("a requeue is fenced by the token", "core/jobs/recovery.py",
          'if token is not None and raw.get("delivery") != token:',
          'if token is not None and not raw.get("delivery"):',
          (f"{JOBS}::test_requeue_is_fenced_and_bounded", f"{JOBS}::test_a_stale_delivery_changes_nothing"),
          "store.requeue(job.id, "),
    # ---------------------------------------------------------------- the three that slipped through
    Guard("no sweep until Redis answered for a lease TTL", "worker/runtime/heartbeat.py",
          "if redis_healthy_for_s < self.lease_ttl_s or self.monotonic() - self._last < self.every_s:",
          "if self.monotonic() - self._last < self.every_s:",
          (f"{HEARTBEAT}::test_after_an_outage_a_worker_sweeps_only_once_redis_answered_for_a_lease_ttl",
           f"{HEARTBEAT}::test_a_gap_between_beats_or_a_stalled_beat_starts_the_count_again"),
          "it must wait a whole lease TTL"),
    Guard("the sweep re-checks the lease in its transaction", "core/jobs/recovery.py",
          "if expired_by is not None and (expiry is None or expiry > expired_by):",
          "if expired_by is not None and expiry is None:",
          (f"{JOBS}::test_an_owner_that_renews_while_the_sweep_reads_keeps_its_job",),
          "although its owner renewed the lease"),
    Guard("a retry is replayed only for the same body", "core/jobs/intake.py",
          'if not isinstance(doc, dict) or doc.get("body") != body_digest or not isinstance(doc.get("job"), str):',
          'if not isinstance(doc, dict) or not isinstance(doc.get("job"), str):',
          ("tests/core/kinds/test_idempotency.py",), "another body under a used Idempotency-Key was answered"),
    # ---------------------------------------------------------------- the front gate, archives, /predict
    Guard("the API key is compared whole", "app/api/access.py",
          "if hmac.compare_digest(given, self.key):  # constant time, whatever `given` is",
          "if hmac.compare_digest(given[:len(self.key)], self.key):",
          ("tests/e2e/test_auth.py::test_every_route_needs_the_key",), "not 401, to a wrong or missing API key"),
    Guard("zip-slip: no '..' anywhere in an entry's path", "core/zip_safety.py",
          'if ".." in parts:', 'if parts[:1] == ("..",):',
          ("tests/core/test_archives.py::test_path_traversal_and_absolute_names",), "DID NOT RAISE"),
    Guard("the /predict byte budget counts the bytes arriving", "app/api/serving/budget.py",
          "if budget.held + n > budget.limit:", "if budget.held > budget.limit:",
          ("tests/app/api/serving/test_budget.py",), "DID NOT RAISE"),
    Guard("an image is held to its own byte limit", "app/api/serving/multipart.py",
          "if self.name == IMAGE_FIELD and size > self.limits.max_image_bytes:",
          "if self.name == IMAGE_FIELD and size > self.limits.max_body_bytes:",
          ("tests/app/api/serving/test_multipart.py::test_limits_are_decided_while_the_body_streams",),
          "DID NOT RAISE"),
    # ---------------------------------------------------------------- training and checkpoints
    Guard("early stopping after `patience` epochs", "worker/training/recipe.py",
          "return self.patience > 0 and self.epochs_without_improvement >= self.patience",
          "return self.patience > 0 and self.epochs_without_improvement > self.patience",
          ("tests/worker/training/test_recipe.py::test_early_stopping_judges_by_the_monitor",
           "tests/worker/training/test_recipe.py::"
           "test_a_saturated_accuracy_stops_by_patience_while_the_tie_break_still_picks_the_weights"),
          "should_stop"),
    Guard("checkpoints load with weights_only", "worker/checkpoints/format.py",
          "payload = torch.load(path, map_location=map_location, weights_only=True)",
          "payload = torch.load(path, map_location=map_location, weights_only=False)",
          ("tests/test_unpickling.py",), "worker/checkpoints/format.py:"),
    # ---------------------------------------------------------------- #41: the sweep's other guards
    Guard("a Redis TIME with a slow round trip is not used", "worker/runtime/heartbeat.py",
          "if round_trip > MAX_CLOCK_ROUND_TRIP_S:", "if round_trip > MAX_CLOCK_ROUND_TRIP_S * 10:",
          (f"{HEARTBEAT}::test_the_sweep_never_uses_a_redis_time_that_took_long_to_come_back",),
          "a clock read that waited out a freeze", group="sweep"),
    Guard("a failed beat restarts the healthy count", "worker/runtime/heartbeat.py",
          "self._last_ok = None", "pass",
          (f"{HEARTBEAT}::test_after_an_outage_a_worker_sweeps_only_once_redis_answered_for_a_lease_ttl",),
          "it must wait a whole lease TTL", group="sweep"),
    Guard("a gap between beats restarts the healthy count", "worker/runtime/heartbeat.py",
          "if self._last_ok is None or done - self._last_ok > self.interval_s + self.stall_s"
          " or done - started > self.stall_s:",
          "if self._last_ok is None or done - started > self.stall_s:",
          (f"{HEARTBEAT}::test_a_gap_between_beats_or_a_stalled_beat_starts_the_count_again",),
          "after a 3 s gap between two beats", group="sweep"),
    Guard("a different resolved request under a used key is refused", "core/jobs/intake.py",
          "if first_request is not None and first_request != fingerprint:",
          "if first_request is None:",
          ("tests/core/kinds/test_idempotency.py", f"{JOBS}::test_idempotency_key_is_bound_to_the_request"),
          "another body under a used Idempotency-Key was answered", group="idempotency"),
    Guard("HTTP: another body under a used key is a 422", "core/jobs/intake.py",
          'if not isinstance(doc, dict) or doc.get("body") != body_digest or not isinstance(doc.get("job"), str):',
          'if not isinstance(doc, dict) or not isinstance(doc.get("job"), str):',
          ("tests/e2e/test_training.py::test_idempotency_validation_and_listing",),
          "another body under a used Idempotency-Key must be a 422", group="idempotency"),
    # ---------------------------------------------------------------- #41: limits at their edge
    Guard("an image of exactly TORCHYARD_MAX_IMAGE_BYTES is taken", "app/api/serving/multipart.py",
          "if self.name == IMAGE_FIELD and size > self.limits.max_image_bytes:",
          "if self.name == IMAGE_FIELD and size >= self.limits.max_image_bytes:",
          ("tests/app/api/serving/test_multipart.py::test_each_limit_takes_a_body_at_its_edge_and_refuses_one_byte_or_image_more",
           "tests/e2e/test_input_limits.py"), "an image of exactly max_image_bytes", group="edges"),
    Guard("exactly TORCHYARD_MAX_IMAGES_PER_REQUEST images are taken, one more refused", "app/api/serving/multipart.py",
          "elif len(self.form.images) >= self.limits.max_images:",
          "elif len(self.form.images) > self.limits.max_images:",
          ("tests/app/api/serving/test_multipart.py::test_each_limit_takes_a_body_at_its_edge_and_refuses_one_byte_or_image_more",),
          "one image more than max_images was not refused", group="edges"),
    Guard("a /predict body of exactly its limit is taken", "app/api/serving/multipart.py",
          "if received > limits.max_body_bytes:", "if received >= limits.max_body_bytes:",
          ("tests/app/api/serving/test_multipart.py::test_each_limit_takes_a_body_at_its_edge_and_refuses_one_byte_or_image_more",),
          "a body of exactly max_body_bytes", group="edges"),
    Guard("an upload of exactly TORCHYARD_MAX_UPLOAD_BYTES is taken", "app/api/uploads.py",
          "if self.file_bytes > self.max_file_bytes:", "if self.file_bytes >= self.max_file_bytes:",
          ("tests/app/api/test_uploads.py::test_an_upload_of_exactly_the_cap_is_taken_and_one_byte_more_is_refused",
           "tests/e2e/test_input_limits.py"), "an upload of exactly TORCHYARD_MAX_UPLOAD_BYTES", group="edges"),
    Guard("a declared Content-Length of exactly the cap is taken", "app/api/front.py",
          "if int(head.content_length) > cap:", "if int(head.content_length) >= cap:",
          ("tests/e2e/test_input_limits.py",), "json of exactly MAX_JSON_BYTES: 413", group="edges"),
    Guard("a streamed body of exactly the cap is taken", "app/api/front.py",
          "if self.received > self.cap:", "if self.received >= self.cap:",
          ("tests/e2e/test_input_limits.py",), "json of exactly MAX_JSON_BYTES, chunked: 413", group="edges"),
    # ---------------------------------------------------------------- #41: the refusal closes
    Guard("a refusal before the body is read closes the connection", "app/api/front.py",
          "await _reply(send, refusal.status, refusal.detail, close=head.has_body, headers=refusal.headers, key=key)",
          "await _reply(send, refusal.status, refusal.detail, close=False, headers=refusal.headers, key=key)",
          ("tests/e2e/test_security.py::test_a_300_mib_unauthenticated_body_is_refused_after_a_few_mib",),
          "left the connection open", group="close"),
)
