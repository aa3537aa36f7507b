# cython: language_level=3
"""1:1 mirror of include/mxfp4x/dispatch.h (and the headers it includes)."""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint64_t

cdef extern from "mxfp4x/dispatch.h" nogil:
    # ---- mxfp4x.h: format facts
    int MXFP4X_GROUP
    int MXFP4X_GROUP_BYTES
    int MXFP4X_GGUF_BLOCK_BYTES
    int MXFP4X_E8M0_BIAS
    int MXFP4X_E8M0_NAN
    int MXFP4X_ISA_SCALAR
    int MXFP4X_ISA_AVX2
    int MXFP4X_ISA_AVX512
    int MXFP4X_ISA_NEON
    int MXFP4X_ISA_AMX
    int MXFP4X_ISA_AVX512BF16
    int MXFP4X_ISA_COUNT
    const char *mxfp4x_isa_name(int isa)
    int MXFP4X_LAYOUT_16
    int MXFP4X_DTYPE_F32
    int MXFP4X_DTYPE_F64
    int MXFP4X_DTYPE_BF16
    int MXFP4X_DTYPE_F16

    int MXFP4X_NIBBLES_PAIRS
    int MXFP4X_NIBBLES_HALVES
    float mxfp4x_bf16_to_f32(uint16_t h)
    float mxfp4x_f16_to_f32(uint16_t h)

    ctypedef struct mxfp4x_rows:
        const uint8_t *blocks
        const uint8_t *scales
        int64_t row_stride_blocks
        int64_t row_stride_scales
        int64_t n_groups
        int64_t group_stride_blocks
        int64_t group_stride_scales
        int nibbles
        const uint8_t *next_blocks
        const uint8_t *next_scales
        int pf_far

    mxfp4x_rows mxfp4x_rows_split(const uint8_t *blocks, const uint8_t *scales,
                                  int64_t row_stride_blocks, int64_t row_stride_scales,
                                  int64_t n_groups)
    mxfp4x_rows mxfp4x_rows_gguf(const uint8_t *base, int64_t row_stride, int64_t n_groups)

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
    ctypedef int64_t (*mxfp4x_scratch_fn)(int64_t n_rows) noexcept nogil
    ctypedef float (*mxfp4x_fma_loop_fn)(int64_t iters, float seed,
                                         int64_t *flops) noexcept nogil
    ctypedef void (*mxfp4x_dense_bf16_fn)(const uint16_t *w, int64_t row_stride,
                                          int64_t row_start, int64_t row_end, int64_t d_in,
                                          const float *x, int64_t x_stride, int64_t n_tok,
                                          float *out, int64_t out_stride) noexcept nogil
    ctypedef void (*mxfp4x_dense_bf16x_fn)(const uint16_t *w, int64_t row_stride,
                                           int64_t row_start, int64_t row_end, int64_t d_in,
                                           const uint16_t *x, int64_t x_stride, int64_t n_tok,
                                           float *out, int64_t out_stride) noexcept nogil
    ctypedef void (*mxfp4x_axpy_rows_f32_fn)(const float *panel, int64_t n_rows,
                                             int64_t width, const float *coef,
                                             float *dst) noexcept nogil
    ctypedef void (*mxfp4x_decode_f64_fn)(const mxfp4x_rows *w, int64_t row_start,
                                          int64_t row_end, double *panel) noexcept nogil
    ctypedef void (*mxfp4x_panel_dot_f64_fn)(const double *panel, int64_t n_rows,
                                             int64_t n_groups, const double *x,
                                             int64_t x_stride, const int64_t *x_rows,
                                             int64_t n_tok, double *out,
                                             int64_t out_stride) noexcept nogil
    ctypedef void (*mxfp4x_axpy_rows_f64_fn)(const double *panel, int64_t n_rows,
                                             int64_t width, const double *coef,
                                             double *dst) noexcept nogil
    ctypedef void (*mxfp4x_bf16_gather_fn)(const uint16_t *x, int64_t x_stride,
                                           const int64_t *src, int64_t n, int64_t n_groups,
                                           int nibbles, uint16_t *dst,
                                           uint8_t *unsafe) noexcept nogil
    ctypedef void (*mxfp4x_bf16_rows_fn)(const mxfp4x_rows *w, int64_t row_start,
                                         int64_t row_end, const uint16_t *xt,
                                         const uint8_t *unsafe, int64_t n_tok, float *out,
                                         int64_t out_stride, void *scratch) noexcept nogil
    ctypedef int64_t (*mxfp4x_bf16_scratch_fn)(int64_t n_groups) noexcept nogil
    ctypedef int (*mxfp4x_count_fn)() noexcept nogil

    ctypedef struct mxfp4x_kernels:
        int isa
        const char *name
        int layout_half
        int panel_row_block
        int gemv_max_tokens
        int tile_rows
        int64_t panel_bytes
        mxfp4x_gemv_f32_fn gemv_f32
        mxfp4x_decode_f32_fn decode_f32
        mxfp4x_panel_dot_f32_fn panel_dot_f32
        mxfp4x_scratch_fn panel_scratch_floats
        mxfp4x_axpy_rows_f32_fn axpy_rows_f32
        mxfp4x_decode_f64_fn decode_f64
        mxfp4x_panel_dot_f64_fn panel_dot_f64
        mxfp4x_axpy_rows_f64_fn axpy_rows_f64
        mxfp4x_fma_loop_fn fma_loop
        mxfp4x_dense_bf16_fn dense_bf16
        mxfp4x_dense_bf16x_fn dense_bf16x
        mxfp4x_dense_bf16x_fn dense_bf16_unit
        mxfp4x_bf16_gather_fn bf16_gather
        mxfp4x_bf16_rows_fn bf16_rows
        mxfp4x_bf16_scratch_fn bf16_scratch_bytes
        mxfp4x_count_fn bf16_gemv_max_tokens
        mxfp4x_fma_loop_fn bf16_dot_loop

    int64_t mxfp4x_layout_pos(int64_t i, int half, int nibbles)

    # ---- mxfp4x.h: the call description
    ctypedef struct mxfp4x_experts:
        int64_t n_experts
        int64_t d_out
        int64_t n_groups
        const mxfp4x_rows *rows

    int MXFP4X_FORWARD
    int MXFP4X_TRANSPOSED
    int MXFP4X_ROWS_PER_TOKEN
    int MXFP4X_ROWS_PER_SLOT

    ctypedef struct mxfp4x_call:
        int product
        int compute
        const mxfp4x_kernels *kernels
        int n_threads
        mxfp4x_experts experts
        int64_t n_tokens
        int64_t top_k
        const int64_t *selected
        const void *mix
        const void *src
        int src_dtype
        int src_rows
        void *dst
        int dst_rows
        int dst_dtype
        const void *init
        int init_dtype

    # ---- config.h
    ctypedef unsigned long long mxfp4x_fpenv  # an integer type on every architecture
    mxfp4x_fpenv mxfp4x_fpenv_enter()
    void mxfp4x_fpenv_exit(mxfp4x_fpenv saved)
    int MXFP4X_BUILT_FAST_MATH
    int MXFP4X_BUILT_GLOBAL_ISA
    int MXFP4X_EMULATED_AVX512
    int MXFP4X_EMULATED_AMX
    const char *MXFP4X_BUILD_CFLAGS

    # ---- cpu.h
    ctypedef struct mxfp4x_cpu_facts:
        int osxsave
        int avx
        int fma
        int avx2
        int avx512f
        uint64_t xcr0
        int darwin_avx512
        int avx512bw
        int amx_tile
        int amx_bf16
        int amx_granted
        int avx512_bf16
    int mxfp4x_isa_decision(const mxfp4x_cpu_facts *f)
    int mxfp4x_isa_default_mask(int vendor_amd, int runnable)
    int mxfp4x_cpu_isas()
    int MXFP4X_N_FEATURES
    int mxfp4x_cpu_features()
    const char *mxfp4x_feature_name(int i)

    # ---- dispatch.h
    int mxfp4x_n_kernels()
    const mxfp4x_kernels *mxfp4x_kernel_at(int i)
    int mxfp4x_kernel_runnable(int i)
    int mxfp4x_gemv_switch(const mxfp4x_kernels *k)
    int mxfp4x_kernel_default_in(int mask)
    int mxfp4x_kernel_default()
    int MXFP4X_SCALAR_TILE_ROWS
    int64_t MXFP4X_SCALAR_PANEL_BYTES

    # ---- threads.h
    int MXFP4X_OPENMP
    int MXFP4X_MAX_THREADS
    ctypedef void (*mxfp4x_task_fn)(void *ctx, int64_t task, int tid) noexcept nogil
    int mxfp4x_run_tasks(int n_threads, int64_t n_tasks, mxfp4x_task_fn fn, void *ctx)
    const char *mxfp4x_threads_name()
    uint64_t mxfp4x_thread_token()

    # ---- scalar.h: the float64 path and the layout permutations
    uint64_t mxfp4x_read_words(const uint64_t *p, int64_t n_words)
    void mxfp4x_decode_f64(const mxfp4x_rows *w, int64_t row_start, int64_t row_end,
                           double *panel)
    void mxfp4x_panel_dot_f64(const double *panel, int64_t n_rows, int64_t n_groups,
                              const double *x, int64_t x_stride, const int64_t *x_rows,
                              int64_t n_tok, double *out, int64_t out_stride)
    void mxfp4x_axpy_rows_f64(const double *panel, int64_t n_rows, int64_t width,
                              const double *coef, double *dst)
    void mxfp4x_prepare_x_f32(const void *row, int dtype, int64_t n_groups, int half,
                              int nibbles, float *dst)
    void mxfp4x_prepare_x_f64(const double *row, int64_t n_groups, int nibbles, double *dst)
    void mxfp4x_natural_f32(const float *src, int64_t n_groups, int half, int nibbles,
                            float *dst)
    void mxfp4x_natural_f64(const double *src, int64_t n_groups, int half, int nibbles,
                            double *dst)
    void mxfp4x_natural_f16s(const float *src, int64_t n_groups, int half, int nibbles,
                             int dst_dtype, uint16_t *dst)
    float mxfp4x_load_f32(const void *row, int dtype, int64_t i)
    # the start of a forward sum, and its one rounding into a 16-bit result
    void mxfp4x_widen_f32(const void *src, int src_dtype, int64_t n, float *dst)
    void mxfp4x_widen_f64(const void *src, int src_dtype, int64_t n, double *dst)
    void mxfp4x_prefetch_slices(const void *base, int64_t stride, int64_t n, int64_t off,
                                int64_t len)
    void mxfp4x_store_f16s(const float *src, int64_t n, int dst_dtype, uint16_t *dst)


cdef extern from "mxfp4x/activation.h" nogil:
    # ---- activation.h: between an MoE layer's two products
    ctypedef struct mxfp4x_swiglu_args:
        const void *gate_up
        int in_dtype
        const void *bias
        int bias_dtype
        const int64_t *ids
        int64_t d_ff
        float limit
        float alpha
        void *out
        int out_dtype
    ctypedef struct mxfp4x_mix_args:
        const float *weights
        const void *rows
        int rows_dtype
        const int64_t *ids
        int64_t top_k
        int64_t d
        float *out
    ctypedef struct mxfp4x_situ_args:
        const void *gate
        const void *up
        int in_dtype
        int64_t n_inner
        int64_t outer
        int64_t inner
        int64_t d
        float beta
        float beta_lin
        void *out
        int out_dtype
    void mxfp4x_act_load(const void *src, int dtype, int64_t first, int64_t step, int64_t n,
                         float *dst)
    void mxfp4x_act_store(const float *src, int64_t n, int dtype, void *dst)
    void mxfp4x_gpt_oss_swiglu(int isa, const mxfp4x_swiglu_args *x, int64_t r0, int64_t r1)
    void mxfp4x_situ_glu(int isa, const mxfp4x_situ_args *x, int64_t r0, int64_t r1)
    void mxfp4x_mix_rows(int isa, const mxfp4x_mix_args *x, int64_t t0, int64_t t1)
    ctypedef struct mxfp4x_rms_norm_args:
        const void *x
        int in_dtype
        const void *weight
        int weight_dtype
        int64_t d
        float eps
        void *out
        int out_dtype
    void mxfp4x_rms_norm(int isa, const mxfp4x_rms_norm_args *x, int64_t r0, int64_t r1)


cdef extern from "mxfp4x/attention.h" nogil:
    # ---- attention.h: a few query tokens over a key/value cache
    ctypedef struct mxfp4x_attention_args:
        const void *q
        const void *k
        const void *v
        const void *mask
        const void *sinks
        int q_dtype, kv_dtype, mask_dtype, sinks_dtype, out_dtype
        int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, m_sb, m_sh, m_st
        int64_t b, hq, hkv, tq, tk, d
        float scaling
        void *out
    int64_t mxfp4x_attention_scratch(int64_t tk, int64_t d)
    int64_t mxfp4x_attention_tasks(const mxfp4x_attention_args *x)
    void mxfp4x_attention(int isa, const mxfp4x_attention_args *x, int64_t t0, int64_t t1,
                          float *scratch)
    void mxfp4x_rope_bf16(uint16_t *x, int64_t n_heads, int64_t d, const uint16_t *cos,
                          const uint16_t *sin)
