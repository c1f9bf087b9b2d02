"""The stream schedule's parts: the dependency DAG and node costs (:mod:`.dag`), the plan of threads, streams,
segments and sections (:mod:`.plan`), and running an annotated graph on its streams (:mod:`.runner`). The pass
itself is :mod:`v4compile.passes.stream_schedule`."""
