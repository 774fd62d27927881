"""A sweep run's ASHA promote/stop decision at a rung, as one script on the sweep's slot.

The rung schedule is the sweep's (sweeps/rungs.py; its record's ``rungs``, ``eta`` and
``rank_metric``); the worker's job runner asks ``RungGate.check`` when a run reports its
metrics. The script records the run's rank value in the rung's sorted set and answers at once:
promote when the run is within the best ceil(n / eta) of the n runs at the rung so far (its own
value included), stop otherwise; so the first run at a rung always goes on.

The decision is stored with the rung (`<job> <step>` in the sweep's decisions hash) in the same
script and never taken again: a run taken over, or reporting the rung again after a restart,
gets the same answer. A run resumed past a rung that stopped it (its worker died before ending
it) asks ``stopped_at_or_before`` when it starts.
"""

from __future__ import annotations

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.keys import Keys
from ssdrbm_server.rank_metrics import metric_value, signed_value
from ssdrbm_server.store.connection import RedisClient, Store
from ssdrbm_server.store.records import JobRecord

# KEYS: the rung's sorted set, the sweep's decisions, the sweep. ARGV: job id, step, signed
# value, eta. Returns "<promote|stop> <runs at the rung> <runs kept>". A deleted sweep decides
# nothing and writes nothing (its runs go on as ordinary jobs, or are being deleted).
_DECIDE = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 'promote 0 0' end
local key = ARGV[1] .. ' ' .. ARGV[2]
local known = redis.call('HGET', KEYS[2], key)
if known then return known end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
local n = redis.call('ZCARD', KEYS[1])
local rank = redis.call('ZRANK', KEYS[1], ARGV[1])
local keep = math.ceil(n / tonumber(ARGV[4]))
local decision = 'stop'
if rank < keep then decision = 'promote' end
local answer = decision .. ' ' .. n .. ' ' .. keep
redis.call('HSET', KEYS[2], key, answer)
return answer
"""


class RungGate(Store):
    """The ASHA decisions of one run (a job): a no-op for jobs outside sweeps or sweeps
    without early stopping. ``stop_reason`` is set once the run is told to stop."""

    def __init__(self, redis: RedisClient, keys: Keys, record: JobRecord) -> None:
        super().__init__(redis, keys=keys)
        self.job_id = record.id
        self.tenant = record.tenant
        self.sweep_id = record.sweep_id
        self.stop_reason = ""
        self._loaded = False
        self._rungs: list[int] = []
        self._eta = 0
        self._metric = ""

    async def _load(self) -> None:
        if self._loaded or not self.sweep_id:
            return
        rungs, eta, metric = await self.redis.hmget(
            self.keys.sweep(self.tenant, self.sweep_id), ["rungs", "eta", "rank_metric"]
        )
        self._rungs = [int(step) for step in (rungs or b"").decode().split(",") if step]
        self._eta = int(eta or 0)
        self._metric = (metric or b"").decode()
        self._loaded = True

    async def check(self, step: int, metrics: bytes) -> bool:
        """Record the run's value at a rung step and say whether it must stop now."""
        if not self.sweep_id or self.stop_reason:
            return False
        await self._load()
        if step not in self._rungs:
            return False
        value = metric_value(pb.Metrics.FromString(metrics), self._metric)
        signed = "inf" if value is None else repr(signed_value(value, self._metric))
        answer = await self.run(
            _DECIDE,
            keys=[
                self.keys.sweep_rung(self.tenant, self.sweep_id, step),
                self.keys.sweep_decisions(self.tenant, self.sweep_id),
                self.keys.sweep(self.tenant, self.sweep_id),
            ],
            args=[self.job_id, step, signed, self._eta],
        )
        return self._note(step, answer)

    async def stopped_at_or_before(self, step: int) -> bool:
        """True when a rung at or before ``step`` already told this run to stop."""
        if not self.sweep_id or self.stop_reason:
            return False
        await self._load()
        passed = [rung for rung in self._rungs if rung <= step]
        if not passed:
            return False
        answers = await self.redis.hmget(
            self.keys.sweep_decisions(self.tenant, self.sweep_id),
            [f"{self.job_id} {rung}" for rung in passed],
        )
        return any(
            self._note(rung, answer) for rung, answer in zip(passed, answers, strict=True) if answer
        )

    def _note(self, step: int, answer: bytes) -> bool:
        decision, runs, kept = answer.decode().split()
        if decision != "stop":
            return False
        self.stop_reason = (
            f"stopped early at rung step {step}: its {self._metric} was not within the best "
            f"{kept} of the {runs} runs that reached the rung (reduction factor {self._eta})"
        )
        return True
