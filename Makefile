# Convenience entry points around scripts/, CMake and ctest. The README's two commands are
# `make run` and `make test`; both install what they need first (scripts/bootstrap.sh).

BUILD       ?= build
ASAN_BUILD  ?= build-asan
FUZZ_BUILD  ?= build-fuzz
TSAN_BUILD  ?= build-tsan
JOBS        ?= $(shell nproc 2>/dev/null || echo 2)
MODEL       ?= models/smollm2-135m-instruct-q4_1.gguf
PROMPT      ?= Once upon a time, a little fox
TOKENS      ?= 96
HOST        ?= 127.0.0.1
PORT        ?= 8080
FUZZ_SECONDS ?=
SOAK_SECONDS ?= 120
CMAKE_FLAGS ?=
PREFIX      ?= /usr/local

.PHONY: all bootstrap model model-gemma3 build install run generate venv test test-fast test-asan test-fuzz test-tsan soak format format-check clean

all: build

bootstrap:
	@bash scripts/bootstrap.sh

model: bootstrap
	@bash scripts/get-model.sh

# The real Gemma 3 270M Q4_K_M (253 MB; about 50 s from scratch here), so that the tests against
# llama.cpp's outputs on it run in `make test` (and CI) instead of skipping.
model-gemma3: bootstrap
	@bash scripts/get-model.sh gemma3-270m

build: bootstrap
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DSH_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# Installs the headers, libshoal.so and libshoal.a, the shoal program, shoal.pc and the CMake
# package under PREFIX (docs/install.md).
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The main job: serve the default model over the OpenAI API on HOST:PORT until Ctrl-C.
run: model build
	./$(BUILD)/shoal serve -m $(MODEL) --host $(HOST) --port $(PORT)

# Generate text from PROMPT on the command line (greedy, TOKENS tokens), without a server.
generate: model build
	./$(BUILD)/shoal run -m $(MODEL) -p "$(PROMPT)" -n $(TOKENS)

# The whole suite: format check, the Release build's tests (the serving tests drive the server
# with the official openai client from .cache/venv, required here), the unit tests again under
# AddressSanitizer and UndefinedBehaviorSanitizer, then each fuzzer for its own time (FUZZ_SECONDS=N: N s each),
# JOBS of them at once (each fuzzer is one process on one core).
# It fetches the Gemma 3 270M file too, whose tests skip without it (test-fast does not fetch it).
test: model model-gemma3 format-check build venv
	cd $(BUILD) && SH_REQUIRE_OPENAI=1 ctest --output-on-failure -j $(JOBS) -LE fuzz
	$(MAKE) test-asan test-fuzz

test-fast: model build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE fuzz

# The chaos soak, not part of `make test`: peers killed and restarted at random under traffic and
# fault rules for SOAK_SECONDS.
soak: build
	cd $(BUILD) && SH_SOAK_SECONDS=$(SOAK_SECONDS) ctest --output-on-failure -L chaos

# The Python environment of the serving tests (the openai package from PyPI).
venv: bootstrap
	@bash scripts/test-venv.sh

test-asan: bootstrap
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DSH_WERROR=ON -DSH_ASAN=ON -DSH_UBSAN=ON -DSH_CUDA=OFF
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) -L unit

# ThreadSanitizer over the tests that run the cluster's threads together (fronts, workers,
# watchdog, supervisor, router, recovery, pipelines of stages in one process and in several, the
# embedding engine and its cluster front). Every report goes to $(TSAN_BUILD)/tsan-reports/ (the
# shoal processes the Python tests start included); any report fails the target. The TSan build
# stretches the tests' time limits by SH_TEST_TIME_SCALE (CMakeLists.txt) and leaves the CPU
# backend's arithmetic kernels uninstrumented (the worker pool that runs them is instrumented).
# Not in CI: its 25 tests took 6.7 minutes here (6 min 50 s for the target with an up-to-date
# build-tsan/; a TSan build from scratch adds about 9 on 2 cores), and CI already takes 17 to 20
# minutes of its 20.
TSAN_TESTS ?= test_engine|test_chaos_kill_(decode|standby)|test_cluster_(router|watchdog|failure|standby|up|status|metrics|forged|preauth|lossy|leak|hosts|tls|bad|pipeline|models|degrade)|test_stage_pipeline|test_admin_status|test_transport_(preauth|tls)
test-tsan: bootstrap model
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSH_WERROR=ON -DSH_TSAN=ON -DSH_CUDA=OFF
	cmake --build $(TSAN_BUILD) -j $(JOBS)
	rm -rf $(TSAN_BUILD)/tsan-reports && mkdir -p $(TSAN_BUILD)/tsan-reports
	cd $(TSAN_BUILD) && TSAN_OPTIONS="log_path=$(abspath $(TSAN_BUILD))/tsan-reports/report second_deadlock_stack=1" \
		ctest --output-on-failure -R '$(TSAN_TESTS)'; rc=$$?; \
		n=$$(ls tsan-reports | wc -l); \
		if [ $$n -gt 0 ]; then echo "test-tsan: $$n report file(s) in $(TSAN_BUILD)/tsan-reports:"; head -40 tsan-reports/*; exit 1; fi; \
		echo "test-tsan: no ThreadSanitizer report"; exit $$rc

test-fuzz: bootstrap
	cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_COMPILER=clang -DSH_FUZZ=ON -DSH_CUDA=OFF -DSH_WERROR=ON -DSH_FUZZ_SECONDS=$(FUZZ_SECONDS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS)
	cd $(FUZZ_BUILD) && ctest --output-on-failure -j $(JOBS) -L fuzz

format:
	clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

format-check: bootstrap
	@files=$$(git ls-files '*.c' '*.h' '*.cu'); \
	bad=$$(for f in $$files; do [ -f "$$f" ] && ! clang-format --dry-run -Werror "$$f" >/dev/null 2>&1 && echo "$$f"; done); \
	if [ -n "$$bad" ]; then echo "format-check: not clang-formatted (run make format):" $$bad; exit 1; fi; \
	echo "format-check: ok"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
