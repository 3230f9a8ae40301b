"""The rank API's insides (:mod:`vigil.sdk` is the public face): a rank's context and
preemption schedule (:mod:`.context`), the optimizer wrapper and the step (:mod:`.step`), the session
that ties them to telemetry, faults and checkpoints (:mod:`.session`)."""
