# cmake -P script: install the built tree into WORK_DIR/prefix, then
# configure, build and run the consumer project against it.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${ATTNKIT_BINARY_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
# With the tool installed, the scripts it runs must be where it looks.
if(EXISTS ${WORK_DIR}/prefix/bin/attnkit)
  foreach(script torch_baseline.py plot.py)
    if(NOT EXISTS ${WORK_DIR}/prefix/share/attnkit/${script})
      message(FATAL_ERROR "installed attnkit lacks share/attnkit/${script}")
    endif()
  endforeach()
endif()
# The Python package, when it was built: importable from the prefix alone.
if(PYTHON_PACKAGE_DIR)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=PYTHONPATH
                  ${PYTHON} ${CHECK_PYTHON} ${WORK_DIR}/prefix ${PYTHON_PACKAGE_DIR}
                  ${PYTHON_DEFAULT_PREFIX} ${PYTHON_EXPECT_DIST} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "the installed Python package failed its check: ${rc}")
  endif()
endif()
# The README's C++ example is built and run as a second consumer, so that
# what it shows stays valid.
file(READ ${README} readme)
string(FIND "${readme}" "```cpp\n" start)
if(start EQUAL -1)
  message(FATAL_ERROR "README has no ```cpp block")
endif()
math(EXPR start "${start} + 7")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} example)
file(WRITE ${WORK_DIR}/readme_example.cc "${example}")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
                -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
                -DREADME_EXAMPLE=${WORK_DIR}/readme_example.cc RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/consumer RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/readme_example RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the README's C++ example failed: ${rc}")
endif()
