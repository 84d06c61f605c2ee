"""The ``retrieval-scan`` workload: retrieval over a shared document pool, scanned by one-off documents.

Shape (the defaults; one hour):

* A pool of ``documents`` documents (1-8k tokens each) behind one shared system prompt. Queries arrive as a
  Poisson process (``query_rate`` per second); each one reads a single document drawn by Zipf popularity
  (weight of the document of rank r is ``r ** -zipf_s``: with 2,000 documents and s = 1, the top 100 get
  63% of the queries, the top 10 about 36%) and adds its own question. The prompt is ``system + document +
  question``, so a query hits the system prompt and the whole document when the document is resident.
* A second Poisson stream (``scan_rate`` per second) brings one-off documents (ingestion, summarization of
  new uploads: 4-16k tokens) that no later request reuses: a scan through the cache. With the defaults a
  third of the requests and most of the new blocks are scans; a recency order lets each scan push out a
  popular document, a frequency-aware or scan-resistant order (S3-FIFO, ARC) should not.
* Classes: a share ``interactive_share`` of the queries (drawn per query) is interactive, priority 0; the
  other queries (batch analytics) are priority 1; scans are priority 2. A document's blocks are shared by
  all classes that read it.

Session ids: ``doc-<d>`` for the queries of document ``d`` (a document's query stream is its "conversation":
the session rules then pick documents), ``scan-<k>`` for scans. Deterministic given the caller's seeded
``random.Random``.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from kvretain.workloads.multi_tenant import poisson_times, seeded_span
from kvretain.workloads.request import Range, WorkloadRequest, WorkloadSize, check_config, scale_and_limit


@dataclass(frozen=True, slots=True)
class RetrievalScanConfig:
    """Settings of the ``retrieval-scan`` workload (see the module docstring); ranges are inclusive uniform."""

    duration_s: float = 3600.0
    system_tokens: int = 1_024
    documents: int = 2_000
    document_tokens: Range = (1_000, 8_000)
    zipf_s: float = 1.0
    query_rate: float = 2.0  # queries per second
    question_tokens: Range = (20, 300)
    answer_tokens: Range = (50, 500)
    interactive_share: float = 0.3
    scan_rate: float = 1.0  # one-off documents per second
    scan_tokens: Range = (4_000, 16_000)
    scan_output_tokens: Range = (100, 500)
    interactive_priority: int = 0
    batch_priority: int = 1
    scan_priority: int = 2

    def __post_init__(self) -> None:
        check_config(
            self,
            "retrieval-scan",
            non_negative=("duration_s", "query_rate", "scan_rate", "zipf_s"),
            probabilities=("interactive_share",),
            at_least_one=("documents",),
        )

    def expected_size(self) -> WorkloadSize:
        """The workload's expected size (:class:`~kvretain.workloads.request.WorkloadSize`), before generating."""
        queries, scans = self.query_rate * self.duration_s, self.scan_rate * self.duration_s
        # a query: system + document + question; a scan: system + its document; a document: one chunk
        return WorkloadSize(queries + scans, 3 * queries + 2 * scans + self.documents, self.documents)


def generate_retrieval_scan(
    config: RetrievalScanConfig | None = None,
    rng: random.Random | None = None,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """The ``retrieval-scan`` workload sorted by arrival; deterministic given ``rng`` (default seed 0)."""
    cfg = config or RetrievalScanConfig()
    rng = rng or random.Random(0)
    docs_rng, query_rng, scan_rng = (random.Random(rng.getrandbits(64)) for _ in range(3))
    system = seeded_span(docs_rng, (cfg.system_tokens, cfg.system_tokens))
    documents = [seeded_span(docs_rng, cfg.document_tokens) for _ in range(cfg.documents)]
    cum = list(itertools.accumulate((r + 1) ** -cfg.zipf_s for r in range(cfg.documents)))
    out: list[WorkloadRequest] = []
    for q, t in enumerate(poisson_times(query_rng, cfg.query_rate, cfg.duration_s)):
        d = query_rng.choices(range(cfg.documents), cum_weights=cum)[0]
        interactive = query_rng.random() < cfg.interactive_share
        answer = seeded_span(query_rng, cfg.answer_tokens)
        out.append(
            WorkloadRequest(
                request_id=f"query-{q}-doc-{d}",
                arrival_s=t,
                prompt=system + documents[d] + seeded_span(query_rng, cfg.question_tokens),
                output_len=len(answer),
                priority=cfg.interactive_priority if interactive else cfg.batch_priority,
                session_id=f"doc-{d}",
                output=answer,
            )
        )
    for k, t in enumerate(poisson_times(scan_rng, cfg.scan_rate, cfg.duration_s)):
        summary = seeded_span(scan_rng, cfg.scan_output_tokens)
        out.append(
            WorkloadRequest(
                request_id=f"scan-{k}",
                arrival_s=t,
                prompt=system + seeded_span(scan_rng, cfg.scan_tokens),
                output_len=len(summary),
                priority=cfg.scan_priority,
                session_id=f"scan-{k}",
                output=summary,
            )
        )
    return scale_and_limit(out, time_scale, limit)
