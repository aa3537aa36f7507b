# cython: language_level=3
"""1:1 mirror of include/mxfp4x/dispatch.h (and the headers it includes)."""
from libc.stdint cimport int64_t, uint8_t

cdef extern from "mxfp4x/dispatch.h" nogil:
    int MXFP4X_GROUP
    int MXFP4X_GROUP_BYTES
    int MXFP4X_ISA_SCALAR
    int MXFP4X_ISA_AVX2
    int MXFP4X_ISA_AVX512
    int MXFP4X_DTYPE_F32
    int MXFP4X_DTYPE_F64
    int MXFP4X_DTYPE_BF16
    int MXFP4X_DTYPE_F16
    int MXFP4X_PANEL_TOKENS
    int MXFP4X_GEMV_MAX_TOKENS
    int64_t MXFP4X_PANEL_SCRATCH_FLOATS(int64_t n_rows)

    ctypedef struct mxfp4x_rows:
        const uint8_t *blocks
        const uint8_t *scales
        int64_t row_stride_blocks
        int64_t row_stride_scales
        int64_t n_groups

    ctypedef void (*mxfp4x_gemv_f32_fn)(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                                        const float *x, int64_t x_stride, const int64_t *x_rows,
                                        int64_t n_tok, float *out,
                                        int64_t out_stride) noexcept nogil
    ctypedef void (*mxfp4x_decode_f32_fn)(const mxfp4x_rows *w, int64_t row_start,
                                          int64_t row_end, float *panel) noexcept nogil
    ctypedef void (*mxfp4x_panel_dot_f32_fn)(const float *panel, int64_t n_rows, int64_t n_groups,
                                             const float *x, int64_t x_stride,
                                             const int64_t *x_rows, int64_t n_tok, float *out,
                                             int64_t out_stride, float *scratch) noexcept nogil

    ctypedef void (*mxfp4x_axpy_rows_f32_fn)(const float *panel, int64_t n_rows,
                                             int64_t width, const float *coef,
                                             float *dst) noexcept nogil

    ctypedef struct mxfp4x_kernels:
        int isa
        const char *name
        int layout_half
        mxfp4x_gemv_f32_fn gemv_f32
        mxfp4x_decode_f32_fn decode_f32
        mxfp4x_panel_dot_f32_fn panel_dot_f32
        mxfp4x_axpy_rows_f32_fn axpy_rows_f32

    float mxfp4x_e8m0_f32(uint8_t s)
    unsigned int mxfp4x_fpenv_enter()
    void mxfp4x_fpenv_exit(unsigned int saved)
    int mxfp4x_cpu_isas()
    int mxfp4x_n_kernels()
    const mxfp4x_kernels *mxfp4x_kernel_at(int i)
    int mxfp4x_kernel_runnable(int i)
    int mxfp4x_have_openmp()

    void mxfp4x_decode_f64(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                           double *panel)
    void mxfp4x_panel_dot_f64(const double *panel, int64_t n_rows, int64_t n_groups,
                              const double *x, int64_t x_stride, const int64_t *x_rows,
                              int64_t n_tok, double *out, int64_t out_stride)
    void mxfp4x_prepare_x_f32(const void *row, int dtype, int64_t n_groups, int half, float *dst)
    void mxfp4x_prepare_x_f64(const double *row, int64_t n_groups, double *dst)
