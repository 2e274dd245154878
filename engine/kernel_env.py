"""The environment variables of the native kernels (engine/kernels.py says what each does), named
once and torch-free: `pdserve serve` passes those set where it runs on to every worker
(pdserve/workers.py)."""

DISABLE_ENV = "PDSERVE_DISABLE_KERNELS"  # "1": every op on its torch path
SKIP_ENV = "PDSERVE_KERNEL_SKIP"  # op[:variant],...: candidates passed over
FORCE_ENV = "PDSERVE_KERNEL_FORCE"  # op:variant,...: used whatever their verdict, unchecked
FAULT_ENV = "PDSERVE_KERNEL_FAULT"  # tests: op[:runtime[:tag]] builds a faulting library
KERNEL_ENV = (DISABLE_ENV, SKIP_ENV, FORCE_ENV, FAULT_ENV)
# set in the self-check's child: a `:runtime` fault stays quiet there
SELF_CHECK_ENV = "PDSERVE_KERNEL_SELF_CHECK"
# tests: a folder where each process lists the kernel builds it loaded (tests/conftest.py)
RECORD_ENV = "PDSERVE_KERNEL_RECORD"
