"""LostWork: the running jobs come out in the victim search's order, least lost work first, at any time."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpunode.cluster.queueing.lostwork import LostWork
from gpunode.cluster.queueing.model import GPU, Job, Plan, RunningJob
from gpunode.placement.model import Request

job_spec = st.tuples(
    st.sampled_from(["a", "b", "c"]),  # queue
    st.sampled_from([0, 500, 1000, 2000, 8000]),  # milli-GPU held
    st.integers(0, 50).map(lambda t: t * 10.0),  # start (ties on purpose)
    st.one_of(st.none(), st.integers(0, 60).map(lambda t: t * 10.0)),  # last checkpoint
    st.integers(1, 3),  # pods
)


def running(i: int, spec: tuple[str, int, float, float | None, int]) -> RunningJob:
    queue, held, start, checkpoint, pods = spec
    job = Job(f"j{i:03d}", queue, (Request(gpus=1),) * pods, start)
    return RunningJob(job=job, start=start, plan=Plan(pods=()), usage={GPU: held}, last_checkpoint=checkpoint)


def expected(jobs: dict[str, RunningJob], queues: set[str], now: float) -> list[tuple[float, int, str]]:
    """The order preemption_for's key gives: (now - since) x milli-GPU, pods, name."""
    out = []
    for r in jobs.values():
        if r.job.queue in queues:
            since = r.start if r.last_checkpoint is None else max(r.start, r.last_checkpoint)
            out.append(((now - since) * r.usage.get(GPU, 0), len(r.job.pods), r.job.name))
    return sorted(out)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(job_spec, max_size=40),
    stops=st.lists(st.integers(0, 39), max_size=10),
    checkpoints=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 70)), max_size=10),
    queues=st.sets(st.sampled_from(["a", "b", "c"])),
    now=st.integers(700, 2000).map(float),
)
def test_jobs_come_out_in_the_victim_order(
    specs: list[tuple[str, int, float, float | None, int]],
    stops: list[int],
    checkpoints: list[tuple[int, int]],
    queues: set[str],
    now: float,
) -> None:
    index = LostWork()
    jobs: dict[str, RunningJob] = {}
    for i, spec in enumerate(specs):
        r = running(i, spec)
        jobs[r.job.name] = r
        index.add(r)
    for i, t in checkpoints:  # as Scheduler.checkpoint does
        r = jobs.get(f"j{i:03d}")
        if r is not None:
            index.remove(r.job.name)
            r.last_checkpoint = t * 10.0
            index.add(r)
    for i in stops:
        jobs.pop(f"j{i:03d}", None)
        index.remove(f"j{i:03d}")  # a second stop of the same job is ignored
    assert list(index.in_order(sorted(queues), now)) == expected(jobs, queues, now)
