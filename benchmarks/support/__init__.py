"""What the benchmark sections share, apart from the sections themselves
(``benchmarks/<name>.py``): the section registry, progress and statistics
(``common``), GPU helpers (``gpu``), the suite's entry point (``suite``, run
by ``python -m cudafut bench``), the report (``report``) and the check of the
figures quoted in the docs (``figures``)."""
