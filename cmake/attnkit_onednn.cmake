# oneDNN, the GEMM behind kernels::linear (docs/GEMM.md), as the imported
# target attnkit::onednn: Debian's libdnnl-dev plus the libgomp it is built
# on (attnkit sets OpenMP's per-thread thread count around each call).
#
# Found by hand rather than with find_package(dnnl): Debian's dnnl-config
# requires the OpenCL development files (for oneDNN's GPU runtime, which
# attnkit does not use). Included by the build and by the installed
# attnkitConfig.cmake, so consumers of the static library get it too.
# Sets ATTNKIT_ONEDNN_FOUND.
if(NOT TARGET attnkit::onednn)
  find_path(ATTNKIT_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.h)
  find_library(ATTNKIT_ONEDNN_LIBRARY NAMES dnnl)
  # Debian ships libgomp.so.1 without the unversioned link outside GCC's
  # private directory; it is the same runtime libdnnl.so is linked with.
  find_library(ATTNKIT_GOMP_LIBRARY NAMES gomp libgomp.so.1)
  mark_as_advanced(ATTNKIT_ONEDNN_INCLUDE_DIR ATTNKIT_ONEDNN_LIBRARY ATTNKIT_GOMP_LIBRARY)
  if(ATTNKIT_ONEDNN_INCLUDE_DIR AND ATTNKIT_ONEDNN_LIBRARY AND ATTNKIT_GOMP_LIBRARY)
    add_library(attnkit::onednn INTERFACE IMPORTED)
    set_target_properties(attnkit::onednn PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${ATTNKIT_ONEDNN_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${ATTNKIT_ONEDNN_LIBRARY};${ATTNKIT_GOMP_LIBRARY}")
  endif()
endif()
if(TARGET attnkit::onednn)
  set(ATTNKIT_ONEDNN_FOUND TRUE)
else()
  set(ATTNKIT_ONEDNN_FOUND FALSE)
endif()
