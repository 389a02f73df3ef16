# Included into llama.cpp's own CMake project while llama-cpp-python builds it
# (CMAKE_PROJECT_llama.cpp_INCLUDE, see the Makefile): llama-cpp-python forces the `common`
# library on, but its Python package loads only libllama and libggml*, and `common` (chat
# parsers, JSON, HTTP client) is a large share of the build. Turning it off here, before
# llama.cpp reads the option, leaves the wheel's contents that logitgate uses unchanged.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
