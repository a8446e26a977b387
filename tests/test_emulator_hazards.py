"""Negative controls: known-good kernels with one planted bug each, which the emulator must
catch (a wrong answer against the reference, a hazard, a deadlock report, a fault). A control
that stopped catching its bug would mean the emulator no longer models what makes that bug
wrong on the GPU."""

from __future__ import annotations

import pytest
from emulator_checks import check, plant

from ptxattn.tools.emulator import Deadlock, HazardError, MemoryFault, SyncError


def kinds(err: HazardError) -> set:
    return {h.kind for h in err.hazards}


def test_a_wrong_descriptor_swizzle_bit_gives_a_wrong_answer(emulated_gpu):
    # stage 3's K operand descriptor says 64-byte swizzle (mode 2) instead of 128-byte (mode 1)
    plant(emulated_gpu, ("or.b64 %desc_k, %desc_k, 0x4000004000010000;",
                         "or.b64 %desc_k, %desc_k, 0x8000004000010000;"))
    with pytest.raises(AssertionError, match="rel_l2"):
        check(emulated_gpu, 3, 1, 1, 128, 128, 128)


def test_a_missing_fence_before_the_tma_store_is_a_hazard(emulated_gpu):
    # stage 12: stmatrix writes O to shared memory, the TMA store reads it; without
    # fence.proxy.async the async proxy may not see the generic proxy's writes
    plant(emulated_gpu, ("fence.proxy.async.shared::cta;", ""))
    with pytest.raises(HazardError) as e:
        check(emulated_gpu, 12, 1, 1, 128, 128, 128)
    assert "unfenced-async-read" in kinds(e.value)
    assert "TMA store" in str(e.value) and "stmatrix" in str(e.value)


def test_a_missing_fence_before_wgmma_reads_shared_memory_is_a_hazard(emulated_gpu):
    # stage 1: P goes through shared memory (st.shared) into the PV wgmma
    plant(emulated_gpu, ("fence.proxy.async.shared::cta;", ""))
    with pytest.raises(HazardError) as e:
        check(emulated_gpu, 1, 1, 1, 64, 64, 128)
    assert "unfenced-async-read" in kinds(e.value) and "wgmma B operand" not in str(e.value)


def test_an_mbarrier_parity_off_by_one_is_reported_as_a_deadlock(emulated_gpu, monkeypatch):
    # the production producer waits on Q EMPTY for the parity of the phase in progress instead
    # of the one just completed: with one persistent CTA walking three Q tiles it waits for a
    # release that needs the tile it has not loaded yet. The report names the waits.
    monkeypatch.setenv("PTXATTN_PERSISTENT_CTAS", "1")
    plant(emulated_gpu, ("    shr.u32 %q_phase, %local_tile, 1;\n"
                         "    add.u32 %q_phase, %q_phase, 1;\n"
                         "    and.b32 %q_phase, %q_phase, 1;\n"
                         "wait_q_empty:",
                         "    shr.u32 %q_phase, %local_tile, 1;\n"
                         "    and.b32 %q_phase, %q_phase, 1;\n"
                         "wait_q_empty:"))
    with pytest.raises(Deadlock) as e:
        check(emulated_gpu, None, 1, 1, 384, 384, 128)
    text = str(e.value)
    assert "mbarrier.try_wait.parity.shared::cta.b64 %p_ready, [%q_buf_empty], %q_phase" in text
    assert "[waiting for the phase of parity 1]" in text and "arrivals pending" in text


def test_a_ring_slot_refilled_before_its_empty_arrive_is_a_hazard(emulated_gpu):
    # stage 7's producer no longer waits for the consumers to release a K slot
    plant(emulated_gpu, ("wait_empty_k:\n"
                         "    mbarrier.try_wait.parity.shared::cta.b64 %p_ready, [%slot_bar], "
                         "%phase;\n    @!%p_ready bra.uni wait_empty_k;\n",
                         "wait_empty_k:\n"))
    # Two reports are right: the refill's TMA into bytes a wgmma still reads (a hazard), or,
    # when the producer laps the ring before the slot's last load landed, its arrive.expect_tx
    # on a FULL barrier whose arrivals are all in (undefined on the GPU: an error)
    with pytest.raises((HazardError, SyncError)) as e:
        check(emulated_gpu, 7, 1, 1, 128, 512, 128)
    if isinstance(e.value, HazardError):
        assert kinds(e.value) & {"tma-overwrite-in-flight-read", "tma-overlapping-loads",
                                 "read-before-tma-landed"}
    else:
        assert "refilled before its consumers released it" in str(e.value)


@pytest.mark.parametrize("seq_k", [100, 130])      # the tail in the first tile, in a later one
def test_an_off_by_one_in_the_tail_mask_gives_a_wrong_answer(emulated_gpu, seq_k):
    # the production kernel's key limit for a ragged last K/V tile lets one key past seq_k
    # through (a zero-filled row of K: score 0, a share of the softmax it must not have); the
    # limit is computed once for a first tile that is also the last, again for a later one
    plant(emulated_gpu,
          ("    mad.lo.u32 %tmp, %quad_col, -2, %key_limit;\n    mov.u32 %key_limit, %tmp;",
           "    mad.lo.u32 %tmp, %quad_col, -2, %key_limit;\n    add.u32 %key_limit, %tmp, 1;"),
          ("    mad.lo.u32 %key_limit, %quad_col, -2, %key_limit;\n",
           "    mad.lo.u32 %key_limit, %quad_col, -2, %key_limit;\n"
           "    add.u32 %key_limit, %key_limit, 1;\n"))
    with pytest.raises(AssertionError, match="rel_l2|LSE"):
        check(emulated_gpu, None, 1, 1, 64, seq_k, 128, return_lse=True)


def test_reading_accumulators_before_wgmma_wait_is_a_hazard(emulated_gpu):
    # stage 1 without the wait for S = Q K^T: the softmax reads S while the tensor core writes it
    plant(emulated_gpu, ("    wgmma.commit_group.sync.aligned;\n"
                         "    wgmma.wait_group.sync.aligned 0;\n    mul.f32 %s0,",
                         "    wgmma.commit_group.sync.aligned;\n    mul.f32 %s0,"))
    with pytest.raises(HazardError) as e:
        check(emulated_gpu, 1, 1, 1, 64, 64, 128)
    assert "wgmma-register-in-flight" in kinds(e.value)


def test_registers_written_between_wgmma_fence_and_wgmma_are_a_hazard(emulated_gpu):
    # stage 2 without the wgmma.fence between packing P (cvt) and the PV wgmma that reads it
    plant(emulated_gpu, ("    cvt.rn.bf16x2.f32 %p15, %s31, %s30;\n    wgmma.fence.sync.aligned;",
                         "    cvt.rn.bf16x2.f32 %p15, %s31, %s30;"))
    with pytest.raises(HazardError) as e:
        check(emulated_gpu, 2, 1, 1, 64, 64, 128)
    assert "missing-wgmma-fence" in kinds(e.value)


def test_an_lse_store_past_the_last_row_is_an_out_of_bounds_fault(emulated_gpu):
    # the production kernel's LSE row check lets row seq_q through: a write past the buffer
    plant(emulated_gpu, ("setp.lt.and.u32 %p_row_ok, %lse_row, %seq_q, %p_row_ok;",
                         "setp.le.and.u32 %p_row_ok, %lse_row, %seq_q, %p_row_ok;"))
    with pytest.raises(MemoryFault) as e:
        check(emulated_gpu, None, 1, 1, 64, 64, 128, return_lse=True)
    text = str(e.value)
    assert "st.global.f32" in text and "outside every live allocation" in text
