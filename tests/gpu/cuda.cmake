# GPU tests: built when SH_CUDA is on; each exits 77 (skipped) where no GPU is visible.
if(SH_CUDA)
  sh_test(test_cuda_probe SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_probe.c LIBS shoal_cuda
          LABELS gpu TIMEOUT 60)
endif()
