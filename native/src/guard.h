/*
 * guard.h: the agent's fault-proof access to a region's usage file, compiled
 * into the CFFI module gpunode._memcap only (never into the preload library).
 *
 * The usage file is mounted read-write into the container, so a tenant can
 * truncate it at any instant; touching a page of a shared mapping that lies
 * past the file's end raises SIGBUS, which would kill the agent. These
 * wrappers call the region.c functions with a SIGBUS handler armed for the
 * calling thread: a fault inside the guarded call on the region's mapping
 * gets a private zero page mapped over the faulting page, the call runs to
 * its end on zeros (so it releases what it holds: mapping, descriptor, slot
 * locks), and the wrapper returns GPUNODE_MEMCAP_ERR_FAULT. Any other
 * SIGBUS goes to the handler installed before ours (or the default action).
 *
 * The block between the "cffi" markers is read by native/build_ffi.py as
 * CFFI declarations; it must stay plain C.
 */
#ifndef GPUNODE_MEMCAP_GUARD_H
#define GPUNODE_MEMCAP_GUARD_H

#include "gpunode_memcap.h"

/* >>> cffi */

/* gpunode_memcap_region_open, _report, _reclaim_dead (self_slot -1) and
 * gpunode_compute_set,
 * returning GPUNODE_MEMCAP_ERR_FAULT when the usage file shrank under the
 * call. The guarded report/reclaim results are not to be used then. */
int gpunode_memcap_guarded_open(struct gpunode_memcap_region *region, const char *dir, int writable);
int gpunode_memcap_guarded_report(const struct gpunode_memcap_region *region, struct gpunode_memcap_report *out);
int gpunode_memcap_guarded_reclaim_dead(struct gpunode_memcap_region *region, uint64_t *reclaimed_bytes,
                                        uint32_t *reclaimed_slots);
int gpunode_memcap_guarded_compute_set(struct gpunode_memcap_region *region, uint32_t share_milli, uint32_t mode);
/* Faults absorbed since the module was loaded (all threads). */
uint64_t gpunode_memcap_guard_faults(void);

/* <<< cffi */

#endif /* GPUNODE_MEMCAP_GUARD_H */
