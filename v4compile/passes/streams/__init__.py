"""The stream schedule's parts, in the order the plan runs them: the dependency DAG and node costs (:mod:`.dag`),
threads, streams and launch order (:mod:`.threads`), segments and their events (:mod:`.segments`), branch names
(:mod:`.naming`), and the plan with its sections (:mod:`.plan`). The pass itself is
:mod:`v4compile.passes.stream_schedule`; running an annotated graph on its streams is the backend's
(:mod:`v4compile.stream_runner`)."""
