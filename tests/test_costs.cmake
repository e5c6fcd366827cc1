# ctest starts the tests of highest COST first; without a cost history (a
# fresh build directory, as in CI) every test costs 0 and they start in the
# order they were defined, which put the longest last and left one core
# idle at the end of `ctest -j2`. These are the gtest cases of the C++
# suite that take longest, with their seconds on 2 vCPUs (the figures
# matter only by their order; docs/RELIABILITY.md, CI). The test programs
# and scripts set theirs where they are defined. Included by ctest after
# gtest_discover_tests' list (tests/CMakeLists.txt); a name that is not
# there (a renamed test) is ignored.
set_tests_properties(ServeEngine.PrefixCachingAndChunkingChangeNoBitsWithTheFastKernels
                     PROPERTIES COST 300)
set_tests_properties(PagedInvariance.RowsAreTheSameBitsHoweverTheSequenceIsChunkedOrBatched
                     ReliabilityDeterminism.SdpaIsBitIdenticalAcrossThreadCountsAndRuns
                     AttentionFast.AbsorbedMlaDecode
                     PROPERTIES COST 20)
set_tests_properties(AttentionFast.DecodeIsBitIdenticalAcrossThreadCounts
                     AttentionFast.DecodeDefaultPlansOverManyKvHeadsAndBatches
                     AttentionFast.PagedKeysAndRaggedQueries
                     LinearBf16Stream.EveryTargetMatchesTheFloat64Loop
                     PROPERTIES COST 10)
