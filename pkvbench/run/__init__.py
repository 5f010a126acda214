"""Running a grid: the runner (one prefill per sample, every cell from it), the Ray executor, the funnel measurement,
and the provenance every run records."""
