/* GPU smoke test: a kernel launch through the CUDA backend matches the same sum on the CPU.
 * Skips (77) where no CUDA device is visible. */
#include "kernels/cuda/cuda.h"
#include "sh_test.h"

static void test_saxpy(void)
{
    enum { N = 100003 }; /* not a multiple of the block size, so the tail is checked */
    static float x[N], y[N], want[N];
    unsigned s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1103515245u + 12345u;
        x[i] = (float)((s >> 8) % 2000) / 1000.0f - 1.0f;
        y[i] = (float)i * 0.001f + 0.5f;
        want[i] = 2.5f * x[i] + y[i];
    }
    sh_error e = {0};
    int rc = sh__cuda_saxpy(2.5f, x, y, N, &e);
    if (rc)
        fprintf(stderr, "saxpy: %s\n", e.msg);
    CHECK_INT_EQ(rc, SH_OK);
    for (int i = 0; i < N; i++)
        if (fabsf(y[i] - want[i]) > 1e-5f) {
            CHECK_NEAR(y[i], want[i], 1e-5);
            break;
        }
}

static const sh_test_case tests[] = {{"saxpy", test_saxpy}, {NULL, NULL}};

int main(int argc, char **argv)
{
    int n = 0;
    char name[256];
    sh__cuda_device_count(&n, name, sizeof name);
    if (n == 0) {
        fprintf(stderr, "no CUDA device: skipped\n");
        return SH_TEST_SKIP;
    }
    fprintf(stderr, "CUDA device 0: %s (%d visible)\n", name, n);
    return sh_test_main(argc, argv, tests);
}
